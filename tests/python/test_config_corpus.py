"""A corpus of real DeepSpeed configs (tests/fixtures/deepspeed, its README names each file's source), each
loaded as the engine reads it, and its outcome asserted against tests/fixtures/deepspeed/expected.json: it
loads, with exactly the DeepSpeed keys listed as ignored and the "auto" values left unresolved; or it is
refused, with exactly the message recorded. No key DeepSpeed knows may be an "unknown key"
(common/src/config.cpp: Note [DeepSpeed features tierzero lacks], Note [Auto values]).

To record a change of outcome on purpose: TIERZERO_RECORD_CORPUS=1 pytest tests/python/test_config_corpus.py
rewrites expected.json; review its diff (every refusal must be one DeepSpeed would also make, or a feature
tierzero lacks), and commit it."""

import json
import os
import pathlib

import pytest

import tierzero

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
EXPECTED = CORPUS / "expected.json"
FILES = sorted(str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*.json") if p != EXPECTED)
# The files whose refusal is an "unknown key" because the key is not one DeepSpeed knows either (DeepSpeed reads
# the top-level keys it knows and passes over the rest), each with the key.
NOT_DEEPSPEED_KEYS = {
    "repo/csrc__aio__py_test__single_process_config.json": "block_size: the sweep settings of DeepSpeed's aio "
                                                           "benchmark script, not an engine config",
    "unit/test_pipe-L23.json": "grandient_accumulation_steps: a misspelling, which DeepSpeed passes over",
}


def outcome(name: str) -> dict:
    try:
        c = tierzero.check_config(CORPUS / name)
    except ValueError as e:
        return {"refused": str(e).replace(str(CORPUS) + "/", "")}
    return {"ignored_keys": c["ignored_keys"], "unresolved_auto": c["unresolved_auto"],
            "zero_stage": c["zero_stage"], "optimizer": c["optimizer"], "precision": c["precision"]}


def test_the_corpus_is_all_there():
    assert len(FILES) >= 100, FILES
    expected = json.loads(EXPECTED.read_text()) if EXPECTED.exists() else {}
    if os.environ.get("TIERZERO_RECORD_CORPUS"):
        EXPECTED.write_text(json.dumps({name: outcome(name) for name in FILES}, indent=1, sort_keys=True) + "\n")
        return  # recorded: review the diff of expected.json and commit it
    assert sorted(expected) == FILES, "a config without a recorded outcome, or an outcome without its config"


@pytest.mark.parametrize("name", FILES)
def test_each_config_has_its_recorded_outcome(name):
    got = outcome(name)
    unknown = "unknown key" in got.get("refused", "")
    assert unknown == (name in NOT_DEEPSPEED_KEYS), f"{name}: {got}"
    if unknown:
        assert NOT_DEEPSPEED_KEYS[name].split(":")[0] in got["refused"]
    assert got == json.loads(EXPECTED.read_text())[name]


def test_the_corpus_shows_what_the_issue_found():
    """The cases the corpus was collected for, read from it rather than from the recorded file."""
    adam = [n for n in FILES if _optimizer_type(n) == "adam" and "adam_w_mode" not in _optimizer_params(n)]
    assert adam, "no config of DeepSpeed's \"Adam\" in the corpus"
    for name in adam:
        if "refused" not in outcome(name):
            assert outcome(name)["optimizer"] == "AdamW", f"{name}: DeepSpeed runs \"Adam\" as AdamW by default"
    getting_started = outcome("tutorials/getting-started-1.json")  # "zero_optimization": true
    assert getting_started.get("zero_stage") == 1, getting_started
    hf = outcome("hf/transformers-ds_config_zero2.json")
    assert "optimizer.params.lr" in hf["unresolved_auto"] and "bf16.enabled" in hf["unresolved_auto"]


def _config(name: str) -> dict:
    try:
        loaded = json.loads((CORPUS / name).read_text())
    except ValueError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _optimizer_type(name: str) -> str:
    opt = _config(name).get("optimizer")
    return str(opt.get("type", "")).lower() if isinstance(opt, dict) else ""


def _optimizer_params(name: str) -> dict:
    opt = _config(name).get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    return params if isinstance(params, dict) else {}
