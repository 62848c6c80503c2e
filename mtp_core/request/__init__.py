"""One request's state, below the engine and speculative decoding (both read and write it, neither owns it):
tokens, KV and decoding state (`sequence.py`), drafting state (`mtp_state.py`), statistics (`stats.py`)."""
