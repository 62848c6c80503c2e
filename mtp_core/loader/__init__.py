from mtp_core.loader.checkpoint import Checkpoint, open_checkpoint
from mtp_core.loader.weights import load_model, resolve_dtype

__all__ = ["Checkpoint", "open_checkpoint", "load_model", "resolve_dtype"]
