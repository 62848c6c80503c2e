"""TensorRT-LLM's examples/llm-api/quickstart_advanced.py, here: `mtp quickstart` with identical flags.

    python examples/quickstart_advanced.py --model_dir DIR --spec_decode_algo MTP --spec_decode_max_draft_len 3
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli.app import main  # noqa: E402

if __name__ == "__main__":
    main(["quickstart", *sys.argv[1:]])
