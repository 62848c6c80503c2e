"""The native CPU forward of a DeepseekV3ForCausalLM, above the model and the loader (it reads their modules):

  native_weights.py  the typed weights the native ops read (`NativeWeights`: in place or repacked, per layout)
  native_decode.py   `NativeDecoder`: one native op call per target / MTP forward, and the LM head
  forward_path.py    per model, the decode-time preparation (`prepare_decode`: weight fusion, then the native
                     decoder where it can serve the model) and an engine's choice of path (`serving_forward`)

The ops themselves and their torch references live in mtp_core/kernels/ (native_ref.py), which imports
nothing from here.
"""
