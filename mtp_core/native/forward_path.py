"""The forward path an engine serves its model with: chosen once per engine, logged, then used by every
serving forward the engine runs (target, MTP modules, LM head).

  native  `NativeDecoder` (native_decode.py): one native op per forward over the paged cache, batch-invariant;
          built once per model where the model allows it (a CPU, the native ops loaded, weights it can read, one
          process); `runtime.native_decode: false` (env MTP_CORE_NATIVE_DECODE=0) keeps it off.
  torch   `TorchForward` (mtp_core/model/forward_path.py): the model's own modules, on every device and for every
          model; the reference the native path is tested against.

The choice lives here, above the model, because the native decoder reads the model's modules (and the loader's
quantized linears) while the model knows nothing of it: `model.native` only holds what `prepare_decode` built.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from mtp_core.model.deepseek_v3 import DeepseekV3ForCausalLM
from mtp_core.model.forward_path import ForwardPath, TorchForward
from mtp_core.native.native_decode import NativeDecoder

log = logging.getLogger("mtp.model")   # the name these lines have always been logged under


def prepare_decode(model: DeepseekV3ForCausalLM) -> Optional[NativeDecoder]:
    """Once per model (engines sharing a model prepare it once): the torch path's decode-time weight fusion
    (model.ensure_decode_fused), then the native CPU decode forward, kept as model.native (None where it cannot
    serve the model, with one log line saying why). A copy of the model drops both (its __getstate__) and is
    prepared again when an engine first uses it."""
    if not getattr(model, "decode_fused", False):
        model.ensure_decode_fused()
        model.native = NativeDecoder.build(model)
    return model.native


def serving_forward(model: DeepseekV3ForCausalLM, draft_vocab: Optional[torch.Tensor] = None) -> ForwardPath:
    """The path an engine over `model` takes: the model's native decoder where it has one (prepared once per
    model by prepare_decode, which logs why not otherwise), else its torch modules. draft_vocab (int64 ids,
    ascending): this engine's drafts are scored over those ids only (its own copy of the decoder, sharing the
    model's weights, or of the torch path)."""
    native = prepare_decode(model)
    path: ForwardPath
    if native is not None:
        path = native if draft_vocab is None else native.with_draft_vocab(model, draft_vocab)
    else:
        path = TorchForward(model, draft_vocab)
    vocab = "" if draft_vocab is None else \
        f"; MTP drafts over {len(draft_vocab)} of {model.config.vocab_size} ids (draft_token_map)"
    log.info("engine forward path: %s%s", path.name, vocab)
    return path
