"""`--extra_llm_api_options` YAML: every key, every failure mode, precedence logging, the old spelling.

Expected values and messages are written out by hand from the YAML text of each case."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from mtp_core.config import CudaGraphConfig, KvCacheConfig, LLMConfig, RuntimeConfig, SpeculativeConfig
from mtp_core.yaml_config import ConfigError, apply_yaml_options, load_yaml_options, valid_yaml_keys

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, text: str, cfg: LLMConfig | None = None, explicit: dict | None = None):
    f = tmp_path / "extra.yml"
    f.write_text(text)
    lines: list[str] = []
    new = apply_yaml_options(cfg or LLMConfig(), load_yaml_options(f), explicit or {}, lines.append)
    return new, lines


def _get(cfg: LLMConfig, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _with_spec(**kw) -> LLMConfig:
    return LLMConfig(speculative_config=SpeculativeConfig(**kw))


EVERY_KEY = """
cuda_graph_config: {batch_sizes: [1, 2, 4], max_batch_size: 4, enable_padding: true}
disable_overlap_scheduler: true
kv_cache_config:
  free_gpu_memory_fraction: 0.5
  tokens_per_block: 32
  max_tokens: 4096
  dtype: FP8
  enable_block_reuse: false
moe_config: {backend: cutlass}
speculative_config:
  decoding_type: mtp
  num_nextn_predict_layers: 2
  use_relaxed_acceptance_for_thinking: true
  relaxed_topk: 10
  relaxed_delta: 0.6
  use_mtp_vanilla: true
  mtp_mode: VANILLA
enable_chunked_prefill: true
max_batch_size: 16
max_num_tokens: 2048
max_seq_len: 1024
tensor_parallel_size: 2
moe_expert_parallel_size: 4
print_iter_log: true
enable_attention_dp: false
dtype: bfloat16
"""
EVERY_KEY_EXPECT = {
    "cuda_graph_config.batch_sizes": [1, 2, 4], "cuda_graph_config.max_batch_size": 4,
    "cuda_graph_config.enable_padding": True, "disable_overlap_scheduler": True,
    "kv_cache_config.free_gpu_memory_fraction": 0.5, "kv_cache_config.tokens_per_block": 32,
    "kv_cache_config.max_tokens": 4096, "kv_cache_config.dtype": "fp8", "moe_config.backend": "CUTLASS",
    "kv_cache_config.enable_block_reuse": False,
    "speculative_config.decoding_type": "MTP", "speculative_config.num_nextn_predict_layers": 2,
    "speculative_config.use_relaxed_acceptance_for_thinking": True, "speculative_config.relaxed_topk": 10,
    "speculative_config.relaxed_delta": 0.6, "speculative_config.use_mtp_vanilla": True,
    "speculative_config.mtp_mode": "vanilla", "enable_chunked_prefill": True, "max_batch_size": 16,
    "max_num_tokens": 2048, "max_seq_len": 1024, "tensor_parallel_size": 2, "moe_expert_parallel_size": 4,
    "print_iter_log": True, "dtype": "bfloat16",
}

GOOD = [  # (id, yaml, starting cfg or None, {dotted attribute: expected})
    ("every_key", EVERY_KEY, None, EVERY_KEY_EXPECT),
    ("graphs_defaults", "cuda_graph_config: {}", None,
     {"cuda_graph_config": CudaGraphConfig(batch_sizes=None, max_batch_size=0, enable_padding=False)}),
    ("graphs_off", "cuda_graph_config: null", LLMConfig(cuda_graph_config=CudaGraphConfig()),
     {"cuda_graph_config": None}),
    ("graphs_max_only", "cuda_graph_config: {max_batch_size: 8}", None, {"cuda_graph_config.max_batch_size": 8}),
    ("int_for_float", "speculative_config: {relaxed_delta: 1}", None, {"speculative_config.relaxed_delta": 1.0}),
    ("fraction_one", "kv_cache_config: {free_gpu_memory_fraction: 1}", None,
     {"kv_cache_config.free_gpu_memory_fraction": 1.0}),
    ("alias_max_draft_len", "speculative_config: {max_draft_len: 4}", None,
     {"speculative_config.num_nextn_predict_layers": 4}),
    ("alias_equal_both", "speculative_config: {max_draft_len: 2, num_nextn_predict_layers: 2}", None,
     {"speculative_config.num_nextn_predict_layers": 2}),
    ("spec_new_gets_defaults", "speculative_config: {relaxed_topk: 3}", None,
     {"speculative_config": SpeculativeConfig(relaxed_topk=3)}),
    ("spec_off", "speculative_config: null", _with_spec(relaxed_topk=5), {"speculative_config": None}),
    ("spec_merges_field_by_field", "speculative_config: {relaxed_delta: 0.5}",
     _with_spec(num_nextn_predict_layers=3, relaxed_topk=5),
     {"speculative_config.relaxed_topk": 5, "speculative_config.num_nextn_predict_layers": 3,
      "speculative_config.relaxed_delta": 0.5}),
    ("max_seq_len_null", "max_seq_len: null", LLMConfig(max_seq_len=100), {"max_seq_len": None}),
    ("max_tokens_null", "kv_cache_config: {max_tokens: null}", LLMConfig(kv_cache_config=KvCacheConfig(max_tokens=9)),
     {"kv_cache_config.max_tokens": None, "kv_cache_config.tokens_per_block": 64}),
    ("moe_auto_any_case", "moe_config: {backend: AUTO}", None, {"moe_config.backend": "auto"}),
    ("empty_file", "", LLMConfig(max_batch_size=3), {"max_batch_size": 3, "speculative_config": None}),
    ("comments_only", "# nothing here\n", None, {"max_batch_size": 8}),
    ("empty_mapping", "{}", None, {"max_num_tokens": 8192}),
]


@pytest.mark.parametrize("text,cfg,expect", [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_good_files(tmp_path, text, cfg, expect):
    before = copy.deepcopy(cfg)
    new, _ = _run(tmp_path, text, cfg)
    for dotted, value in expect.items():
        got = _get(new, dotted)
        assert got == value and type(got) is type(value), (dotted, got, value)
    assert cfg == before  # the input config is never changed


def test_every_key_logs_only_the_no_effect_notes(tmp_path):
    _, lines = _run(tmp_path, EVERY_KEY)
    assert lines == [
        "enable_attention_dp=false is accepted but has no effect here "
        "(one device; attention data parallelism is not implemented)",
    ]


BAD = [  # (id, yaml, the whole message or its start, for messages with a long tail)
    # unknown keys at each depth, with the closest valid key
    ("top", "speculative_confg: {}", "unknown key speculative_confg; did you mean speculative_config?"),
    ("top_plural", "max_batch_sizes: 4", "unknown key max_batch_sizes; did you mean max_batch_size?"),
    ("top_no_match", "zzz: 1", "unknown key zzz; valid keys here: cuda_graph_config, disable_overlap"),
    ("spec", "speculative_config: {relaxed_top_k: 3}",
     "unknown key speculative_config.relaxed_top_k; did you mean relaxed_topk?"),
    ("kv", "kv_cache_config: {free_gpu_mem_fraction: 0.5}",
     "unknown key kv_cache_config.free_gpu_mem_fraction; did you mean free_gpu_memory_fraction?"),
    ("kv_typo", "kv_cache_config: {dtype: fp8, dtpye: fp8}", "unknown key kv_cache_config.dtpye; did you mean dtype?"),
    ("graphs", "cuda_graph_config: {batch_size: [1]}",
     "unknown key cuda_graph_config.batch_size; did you mean batch_sizes?"),
    ("moe", "moe_config: {backnd: auto}", "unknown key moe_config.backnd; did you mean backend?"),
    ("old", "pytorch_backend_config: {use_cuda_graphs: true}",
     "unknown key pytorch_backend_config.use_cuda_graphs; did you mean use_cuda_graph?"),
    ("spec_no_match", "speculative_config: {qqq: 1}", "unknown key speculative_config.qqq; valid keys here: "),
    # wrong types
    ("bool_for_int", "max_batch_size: true", "max_batch_size: expected an integer (>= 1), got boolean true"),
    ("float_for_int", "max_batch_size: 4.0", "max_batch_size: expected an integer (>= 1), got number 4.0"),
    ("yes_for_int", "speculative_config: {relaxed_topk: yes}",
     "speculative_config.relaxed_topk: expected an integer (>= 1), got boolean true"),
    ("str_for_float", "speculative_config: {relaxed_delta: '0.6'}",
     "speculative_config.relaxed_delta: expected a number (>= 0), got string 0.6"),
    ("exponent_str", "speculative_config: {relaxed_delta: 6e-1}",
     "speculative_config.relaxed_delta: expected a number (>= 0), got string 6e-1; PyYAML reads exponents"),
    ("nan", "speculative_config: {relaxed_delta: .nan}",
     "speculative_config.relaxed_delta: expected a number (>= 0), got number nan; it must be finite"),
    ("int_for_bool", "speculative_config: {use_relaxed_acceptance_for_thinking: 1}",
     "speculative_config.use_relaxed_acceptance_for_thinking: expected true or false, got integer 1"),
    ("str_for_bool", "disable_overlap_scheduler: 'false'",
     "disable_overlap_scheduler: expected true or false, got string false"),
    ("no_for_str", "moe_config: {backend: no}",
     "moe_config.backend: expected a string (one of auto, CUTLASS, TRTLLM, WIDEEP, CUTEDSL, DEEPGEMM, VANILLA, "
     "TRITON), got boolean false; YAML reads yes/no/on/off as booleans, quote the value"),
    ("int_for_str", "dtype: 16", "dtype: expected a string (one of auto, float32, bfloat16, float16), got integer 16"),
    ("list_for_mapping", "kv_cache_config: [0.9]", "kv_cache_config: expected a mapping (keys: "),
    ("null_for_mapping", "kv_cache_config: null", "kv_cache_config: expected a mapping (keys: "),
    ("scalar_for_section", "speculative_config: MTP",
     "speculative_config: expected a mapping or null (keys: decoding_type, "),
    ("int_for_list", "cuda_graph_config: {batch_sizes: 4}",
     "cuda_graph_config.batch_sizes: expected a list of integers (non-empty, each >= 1; or null), got integer 4"),
    ("str_in_list", "cuda_graph_config: {batch_sizes: [1, two]}",
     "cuda_graph_config.batch_sizes: expected a list of integers"),
    ("empty_list", "cuda_graph_config: {batch_sizes: []}", "cuda_graph_config.batch_sizes: expected a list of"),
    ("null_for_int", "max_batch_size: null", "max_batch_size: expected an integer (>= 1), got null"),
    ("old_not_mapping", "pytorch_backend_config: [1]",
     "pytorch_backend_config: expected a mapping (deprecated section), got list"),
    ("old_str_for_bool", "pytorch_backend_config: {use_cuda_graph: 'yes'}",
     "pytorch_backend_config.use_cuda_graph: expected true or false, got string yes"),
    # out of range
    ("negative_delta", "speculative_config: {relaxed_delta: -0.1}",
     "speculative_config.relaxed_delta: must be >= 0, got -0.1"),
    ("topk_zero", "speculative_config: {relaxed_topk: 0}", "speculative_config.relaxed_topk: must be >= 1, got 0"),
    ("nextn_zero", "speculative_config: {num_nextn_predict_layers: 0}",
     "speculative_config.num_nextn_predict_layers: must be >= 1, got 0"),
    ("draft_len_zero", "speculative_config: {max_draft_len: 0}",
     "speculative_config.max_draft_len: must be >= 1, got 0"),
    ("fraction_zero", "kv_cache_config: {free_gpu_memory_fraction: 0}",
     "kv_cache_config.free_gpu_memory_fraction: must be in (0, 1], got 0"),
    ("fraction_big", "kv_cache_config: {free_gpu_memory_fraction: 1.5}",
     "kv_cache_config.free_gpu_memory_fraction: must be in (0, 1], got 1.5"),
    ("block_zero", "kv_cache_config: {tokens_per_block: 0}", "kv_cache_config.tokens_per_block: must be >= 1, got 0"),
    ("max_tokens_zero", "kv_cache_config: {max_tokens: 0}",
     "kv_cache_config.max_tokens: must be >= 1 or null, got 0"),
    ("kv_dtype", "kv_cache_config: {dtype: int8}",
     "kv_cache_config.dtype: must be one of auto, fp8, float32, bfloat16, float16, got int8"),
    ("mtp_mode", "speculative_config: {mtp_mode: medusa}",
     "speculative_config.mtp_mode: must be one of auto, eagle, vanilla, got medusa"),
    ("decoding_type", "speculative_config: {decoding_type: Eagle}",
     "speculative_config.decoding_type: must be MTP (case-insensitive), got Eagle"),
    ("moe_backend", "moe_config: {backend: foo}", "moe_config.backend: must be one of auto, CUTLASS, "),
    ("dtype", "dtype: fp64", "dtype: must be one of auto, float32, bfloat16, float16, got fp64"),
    ("seq_len", "max_seq_len: 1", "max_seq_len: must be >= 2 or null, got 1"),
    ("tp_zero", "tensor_parallel_size: 0", "tensor_parallel_size: must be >= 1, got 0"),
    ("ep_negative", "moe_expert_parallel_size: -1", "moe_expert_parallel_size: must be >= 1, got -1"),
    ("num_tokens", "max_num_tokens: 0", "max_num_tokens: must be >= 1, got 0"),
    ("graph_max_neg", "cuda_graph_config: {max_batch_size: -1}",
     "cuda_graph_config.max_batch_size: must be >= 0, got -1"),
    ("graph_size_zero", "cuda_graph_config: {batch_sizes: [0, 2]}",
     "cuda_graph_config.batch_sizes: must be non-empty, each >= 1; or null, got [0, 2]"),
    # rules across keys
    ("graph_max_mismatch", "cuda_graph_config: {batch_sizes: [1, 2, 4], max_batch_size: 8}",
     "cuda_graph_config.max_batch_size=8 must be 0 or the largest of batch_sizes (4)"),
    ("vanilla_vs_eagle", "speculative_config: {use_mtp_vanilla: true, mtp_mode: eagle}",
     "speculative_config.use_mtp_vanilla=true contradicts mtp_mode=eagle; set one of them"),
    ("alias_conflict", "speculative_config: {num_nextn_predict_layers: 3, max_draft_len: 2}",
     "speculative_config.max_draft_len=2 conflicts with speculative_config.num_nextn_predict_layers=3; "),
    ("old_vs_new", "cuda_graph_config: null\npytorch_backend_config: {use_cuda_graph: true}",
     "pytorch_backend_config.use_cuda_graph=true conflicts with cuda_graph_config=null; "),
    ("old_overlap_vs_new", "disable_overlap_scheduler: true\npytorch_backend_config: {enable_overlap_scheduler: true}",
     "pytorch_backend_config.enable_overlap_scheduler=true conflicts with disable_overlap_scheduler=true; "),
    ("old_graphs_off", "pytorch_backend_config: {use_cuda_graph: false, cuda_graph_batch_sizes: [1]}",
     "pytorch_backend_config.cuda_graph_batch_sizes has no effect while CUDA graphs are off"),
    ("old_graphs_not_on", "cuda_graph_padding_enabled: true",
     "cuda_graph_padding_enabled has no effect while CUDA graphs are off"),
]


@pytest.mark.parametrize("text,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_files(tmp_path, text, message):
    cfg = LLMConfig()
    before = copy.deepcopy(cfg)
    lines: list[str] = []
    f = tmp_path / "bad.yml"
    f.write_text("max_batch_size: 99\n" * ("max_batch_size" not in text) + text)  # a good key first
    with pytest.raises(ConfigError) as err:
        apply_yaml_options(cfg, load_yaml_options(f), {"max_batch_size": 4}, lines.append)
    msg = str(err.value)
    assert msg.startswith(message), msg
    assert "\n" not in msg
    assert cfg == before and lines == []  # nothing changed, nothing logged


def test_error_carries_key_path(tmp_path):
    f = tmp_path / "x.yml"
    f.write_text("speculative_config: {relaxed_topk: 0}")
    with pytest.raises(ConfigError) as err:
        apply_yaml_options(LLMConfig(), load_yaml_options(f), {}, print)
    assert err.value.path == "speculative_config.relaxed_topk"
    assert isinstance(err.value, ValueError)


LOAD_BAD = [  # (id, file text, message after "<file>: ")
    ("list", "- a\n- b\n", "the top level must be a mapping of keys (e.g. speculative_config: ...), got list"),
    ("scalar", "hello\n", "the top level must be a mapping of keys (e.g. speculative_config: ...), got string hello"),
    ("number", "3\n", "the top level must be a mapping of keys (e.g. speculative_config: ...), got integer 3"),
    ("colon", "a: 1\nb: 2\nc: d: e\n", "YAML syntax error at line 3, column 5: mapping values are not allowed here"),
    ("bracket", "speculative_config:\n  relaxed_topk: [1, 2\nfoo: 1\n", "YAML syntax error at line 3, column 4: "),
    ("tab", "a:\n\tb: 1\n", "YAML syntax error at line 2, column 1: found character '\\t' that cannot start"),
    ("duplicate", "speculative_config: {relaxed_topk: 2}\nmax_batch_size: 1\nspeculative_config: {}\n",
     "duplicate key 'speculative_config' at line 3; keep only one"),
    ("duplicate_nested", "kv_cache_config:\n  dtype: fp8\n  dtype: auto\n", "duplicate key 'dtype' at line 3;"),
    ("python_tag", "a: !!python/object/apply:os.system ['true']\n", "YAML syntax error at line 1, column 4: "),
]


@pytest.mark.parametrize("text,message", [b[1:] for b in LOAD_BAD], ids=[b[0] for b in LOAD_BAD])
def test_load_errors(tmp_path, text, message):
    f = tmp_path / "bad.yml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_yaml_options(f)
    assert str(err.value).startswith(f"{f}: {message}"), str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.yml: cannot read the YAML file \(FileNotFoundError"):
        load_yaml_options(tmp_path / "nope.yml")


def test_apply_rejects_non_mapping():
    with pytest.raises(ConfigError, match=r"^top level: expected a mapping of keys, got list$"):
        apply_yaml_options(LLMConfig(), [1, 2], {}, print)  # type: ignore[arg-type]


OVERRIDES = [  # (id, yaml, cfg from the flags, flags the user typed, expected log lines, {attr: value})
    ("topk", "speculative_config: {relaxed_topk: 10}", _with_spec(relaxed_topk=5), {"relaxed_topk": 5},
     ["YAML speculative_config.relaxed_topk=10 overrides --relaxed_topk 5"], {"speculative_config.relaxed_topk": 10}),
    ("flag_not_typed", "speculative_config: {relaxed_topk: 10}", _with_spec(relaxed_topk=5), {}, [],
     {"speculative_config.relaxed_topk": 10}),
    ("yaml_silent_on_flag", "speculative_config: {relaxed_delta: 0.6}", _with_spec(relaxed_topk=5),
     {"relaxed_topk": 5}, [], {"speculative_config.relaxed_topk": 5, "speculative_config.relaxed_delta": 0.6}),
    ("nextn_alias", "speculative_config: {max_draft_len: 3}", _with_spec(num_nextn_predict_layers=2),
     {"spec_decode_nextn": 2}, ["YAML speculative_config.max_draft_len=3 overrides --spec_decode_nextn 2"],
     {"speculative_config.num_nextn_predict_layers": 3}),
    ("draft_len", "speculative_config: {num_nextn_predict_layers: 1}", _with_spec(num_nextn_predict_layers=4),
     {"spec_decode_max_draft_len": 4},
     ["YAML speculative_config.num_nextn_predict_layers=1 overrides --spec_decode_max_draft_len 4"],
     {"speculative_config.num_nextn_predict_layers": 1}),
    ("bool_flag", "speculative_config: {use_relaxed_acceptance_for_thinking: false}",
     _with_spec(use_relaxed_acceptance_for_thinking=True), {"use_relaxed_acceptance_for_thinking": True},
     ["YAML speculative_config.use_relaxed_acceptance_for_thinking=false overrides "
      "--use_relaxed_acceptance_for_thinking"], {"speculative_config.use_relaxed_acceptance_for_thinking": False}),
    ("fraction", "kv_cache_config: {free_gpu_memory_fraction: 0.5}", None, {"kv_cache_fraction": 0.9},
     ["YAML kv_cache_config.free_gpu_memory_fraction=0.5 overrides --kv_cache_fraction 0.9"],
     {"kv_cache_config.free_gpu_memory_fraction": 0.5}),
    ("kv_dtype", "kv_cache_config: {dtype: fp8}", None, {"kv_cache_dtype": "auto"},
     ["YAML kv_cache_config.dtype=fp8 overrides --kv_cache_dtype auto"], {"kv_cache_config.dtype": "fp8"}),
    ("tp", "tensor_parallel_size: 1", LLMConfig(tensor_parallel_size=2), {"tp_size": 2},
     ["YAML tensor_parallel_size=1 overrides --tp_size 2"], {"tensor_parallel_size": 1}),
    ("ep", "moe_expert_parallel_size: 2", None, {"moe_ep_size": 1},
     ["YAML moe_expert_parallel_size=2 overrides --moe_ep_size 1"], {"moe_expert_parallel_size": 2}),
    ("graphs_off", "cuda_graph_config: null", LLMConfig(cuda_graph_config=CudaGraphConfig()),
     {"use_cuda_graph": True}, ["YAML cuda_graph_config=null overrides --use_cuda_graph"],
     {"cuda_graph_config": None}),
    ("graphs_on", "cuda_graph_config: {enable_padding: true}", None, {"use_cuda_graph": False},
     ["YAML cuda_graph_config={enable_padding: true} overrides --use_cuda_graph false"],
     {"cuda_graph_config.enable_padding": True}),
    ("spec_off", "speculative_config: null", _with_spec(relaxed_topk=5),
     {"spec_decode_algo": "MTP", "relaxed_topk": 5, "max_tokens": 64},
     ["YAML speculative_config=null overrides --spec_decode_algo MTP",
      "YAML speculative_config=null overrides --relaxed_topk 5"], {"speculative_config": None}),
    ("scheduler", "disable_overlap_scheduler: false", LLMConfig(disable_overlap_scheduler=True),
     {"disable_overlap_scheduler": True}, ["YAML disable_overlap_scheduler=false overrides --disable_overlap_scheduler"],
     {"disable_overlap_scheduler": False}),
    ("old_overlap", "pytorch_backend_config: {enable_overlap_scheduler: true}",
     LLMConfig(disable_overlap_scheduler=True), {"disable_overlap_scheduler": True},
     ["warning: pytorch_backend_config.enable_overlap_scheduler is deprecated (TensorRT-LLM < 1.0 spelling); "
      "write disable_overlap_scheduler (inverted)",
      "YAML pytorch_backend_config.enable_overlap_scheduler=true overrides --disable_overlap_scheduler"],
     {"disable_overlap_scheduler": False}),
    ("several_in_file_order", "max_seq_len: 512\nmax_batch_size: 2\nmax_num_tokens: 100", None,
     {"max_batch_size": 4, "max_seq_len": 256, "max_num_tokens": 50},
     ["YAML max_seq_len=512 overrides --max_seq_len 256", "YAML max_batch_size=2 overrides --max_batch_size 4",
      "YAML max_num_tokens=100 overrides --max_num_tokens 50"],
     {"max_seq_len": 512, "max_batch_size": 2, "max_num_tokens": 100}),
]


@pytest.mark.parametrize("text,cfg,flags,lines,expect", [o[1:] for o in OVERRIDES], ids=[o[0] for o in OVERRIDES])
def test_precedence_and_override_log(tmp_path, text, cfg, flags, lines, expect):
    new, got = _run(tmp_path, text, cfg, flags)
    assert got == lines
    for dotted, value in expect.items():
        assert _get(new, dotted) == value, dotted


OLD_NESTED = """
pytorch_backend_config:
  use_cuda_graph: true
  cuda_graph_batch_sizes: [1, 2, 4]
  cuda_graph_max_batch_size: 4
  cuda_graph_padding_enabled: true
  enable_overlap_scheduler: false
  kv_cache_dtype: fp8
  moe_backend: cutlass
  print_iter_log: true
"""
OLD_FLAT = """
use_cuda_graph: true
cuda_graph_batch_sizes: [1, 2, 4]
cuda_graph_max_batch_size: 4
cuda_graph_padding_enabled: true
enable_overlap_scheduler: false
kv_cache_dtype: fp8
moe_backend: cutlass
print_iter_log: true
enable_attention_dp: true
"""
OLD_EXPECT = {"cuda_graph_config": CudaGraphConfig(batch_sizes=[1, 2, 4], max_batch_size=4, enable_padding=True),
              "disable_overlap_scheduler": True, "kv_cache_config.dtype": "fp8", "moe_config.backend": "CUTLASS",
              "print_iter_log": True}


@pytest.mark.parametrize("text,prefix,num_old", [(OLD_NESTED, "pytorch_backend_config.", 8), (OLD_FLAT, "", 7)],
                         ids=["nested", "flat"])
def test_deprecated_spelling(tmp_path, text, prefix, num_old):
    new, lines = _run(tmp_path, text)
    for dotted, value in OLD_EXPECT.items():
        assert _get(new, dotted) == value, dotted
    warnings = [line for line in lines if "is deprecated" in line]
    assert len(warnings) == num_old
    assert (f"warning: {prefix}kv_cache_dtype is deprecated (TensorRT-LLM < 1.0 spelling); "
            "write kv_cache_config.dtype") in warnings
    assert (f"warning: {prefix}use_cuda_graph is deprecated (TensorRT-LLM < 1.0 spelling); "
            "write cuda_graph_config: {} (null = off)") in warnings


def test_old_graph_keys_apply_to_graphs_enabled_by_flag(tmp_path):
    cfg = LLMConfig(cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2]))
    new, _ = _run(tmp_path, "pytorch_backend_config: {cuda_graph_padding_enabled: true}", cfg)
    assert new.cuda_graph_config == CudaGraphConfig(batch_sizes=[1, 2], max_batch_size=0, enable_padding=True)


def test_old_use_cuda_graph_false_turns_graphs_off(tmp_path):
    new, _ = _run(tmp_path, "pytorch_backend_config: {use_cuda_graph: false}",
                  LLMConfig(cuda_graph_config=CudaGraphConfig()))
    assert new.cuda_graph_config is None


def test_options_not_aliased(tmp_path):
    options = {"cuda_graph_config": {"batch_sizes": [1, 2]}}
    snapshot = copy.deepcopy(options)
    new = apply_yaml_options(LLMConfig(), options, {}, print)
    new.cuda_graph_config.batch_sizes.append(8)
    assert options == snapshot


def test_valid_yaml_keys_tree():
    tree = valid_yaml_keys()
    sections = {"cuda_graph_config": {"batch_sizes", "max_batch_size", "enable_padding"},
                "kv_cache_config": {"free_gpu_memory_fraction", "tokens_per_block", "max_tokens", "dtype",
                                    "enable_block_reuse"},
                "moe_config": {"backend"},
                "runtime": {"kernels", "cpu_isa", "native_decode", "native_layout", "device"},
                "speculative_config": {"decoding_type", "num_nextn_predict_layers", "max_draft_len",
                                       "use_relaxed_acceptance_for_thinking", "relaxed_topk", "relaxed_delta",
                                       "use_mtp_vanilla", "mtp_mode", "draft_len_policy", "draft_confidence_threshold",
                                       "draft_len_schedule", "acceptance_window", "acceptance_length_threshold",
                                       "draft_token_map"},
                "pytorch_backend_config": {"use_cuda_graph", "cuda_graph_batch_sizes", "cuda_graph_max_batch_size",
                                           "cuda_graph_padding_enabled", "enable_overlap_scheduler",
                                           "disable_overlap_scheduler", "kv_cache_dtype", "moe_backend",
                                           "print_iter_log"}}
    leaves = {"disable_overlap_scheduler", "enable_chunked_prefill", "max_batch_size", "max_num_tokens",
              "max_seq_len", "tensor_parallel_size", "moe_expert_parallel_size", "print_iter_log",
              "enable_attention_dp", "dtype", "use_cuda_graph", "cuda_graph_batch_sizes",
              "cuda_graph_max_batch_size", "cuda_graph_padding_enabled", "enable_overlap_scheduler",
              "kv_cache_dtype", "moe_backend"}
    assert set(tree) == set(sections) | leaves
    for name, keys in sections.items():
        assert set(tree[name]) == keys, name
    assert tree["speculative_config"]["relaxed_topk"] == "an integer >= 1"
    assert tree["speculative_config"]["draft_len_policy"] == "a string one of cost, fixed"
    assert tree["kv_cache_config"]["free_gpu_memory_fraction"] == "a number in (0, 1]"


def test_repo_example_loads():
    options = load_yaml_options(REPO / "extra-llm-api-config.yml")
    lines: list[str] = []
    new = apply_yaml_options(LLMConfig(), options, {}, lines.append)
    spec = new.speculative_config
    assert (spec.decoding_type, spec.num_nextn_predict_layers, spec.relaxed_topk, spec.relaxed_delta) == \
        ("MTP", 3, 10, 0.6)
    assert spec.use_relaxed_acceptance_for_thinking is True
    assert new.disable_overlap_scheduler is False
    assert new.kv_cache_config.tokens_per_block == 64
    assert 0 < new.kv_cache_config.free_gpu_memory_fraction <= 1
    assert new.cuda_graph_config is not None and new.cuda_graph_config.batch_sizes
    assert new.runtime == RuntimeConfig()
    assert lines == []


def test_the_python_api_takes_the_yaml_spellings_and_an_empty_size_list() -> None:
    """One validation for every route: the Python API normalises a value as the YAML loader does (case of a
    choice), and its empty list of graph sizes means the default sizes, as it always did."""
    from mtp_core.config import CudaGraphConfig, LLMConfig, MoeConfig

    cfg = LLMConfig(moe_config=MoeConfig(backend="vanilla"), cuda_graph_config=CudaGraphConfig(batch_sizes=[]))
    cfg.validate()
    assert cfg.moe_config.backend == "VANILLA" and cfg.cuda_graph_config.batch_sizes is None
    with pytest.raises(ValueError, match="moe_config.backend"):
        LLMConfig(moe_config=MoeConfig(backend="fastest")).validate()
