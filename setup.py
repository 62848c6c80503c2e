"""Install with: pip install torch==2.13.0 && pip install --no-build-isolation -e ".[test]"

Native extensions (csrc/) are built by setup_ext.py when present: the CPU op always, the CUDA ops only
with a CUDA torch and CUDA_HOME; MTP_CORE_BUILD_EXT=0 skips native code (the torch reference is used).
"""
import os
import sys

from setuptools import find_packages, setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ext_modules, cmdclass = [], {}
if os.environ.get("MTP_CORE_BUILD_EXT", "1") != "0":
    try:
        from setup_ext import get_extensions
        ext_modules, cmdclass = get_extensions()
    except ImportError as e:  # no torch at build time (build isolation) or no setup_ext: pure Python install
        print(f"mtp-core: building without native extensions ({e})", file=sys.stderr)

setup(
    name="mtp-core",
    version="0.1.0",
    description="DeepSeek-V3/R1 inference with MTP speculative decoding (TensorRT-LLM quickstart mirror)",
    packages=find_packages(include=["cli", "cli.*", "mtp_core", "mtp_core.*", "mtp_factory", "mtp_factory.*"]),
    package_data={"mtp_core": ["assets/*/*", "assets/*/*/*"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "typer>=0.12", "rich", "pyyaml", "safetensors", "tokenizers", "jinja2",
                      "fastapi>=0.110", "uvicorn>=0.29", "httpx>=0.27",    # `mtp serve`, `mtp bench --base_url`
                      "msgspec>=0.18",                                      # serve: API <-> engine process messages
                      # serve: response_format, structured_outputs, forced tool calls (xgrammar asks for torch>=1.10,
                      # so the torch already installed stays; transformers builds its tokenizer view)
                      "xgrammar>=0.1.25", "transformers>=4.57"],
    extras_require={
        "test": ["pytest", "hypothesis", "transformers>=4.57", "openai>=1.40", "httpx>=0.27", "jsonschema",
                 "langchain-openai", "xgrammar>=0.1.25"],
        "structured": [],      # kept for old install commands: structured output's packages are dependencies now
        "peers": ["transformers>=4.57"],
        "plot": ["matplotlib"],
        "gpu": ["deep_gemm"],
    },
    entry_points={"console_scripts": ["mtp=cli.app:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
