"""Per-model prompts end to end: a sentence-transformers directory with e5-style prompts,
ingested into the session's store, embedded through a real Module and llama.cpp worker, through
the CLI and the bulk job; and Matryoshka widths from the manifest."""

from __future__ import annotations

import json

import numpy as np
import pytest

from batch.job import JobOptions, run_job
from batch.output import read_metadata
from common.errors import InvalidRequest
from host.config import HostConfig
from host.module import Module, ModuleConfig
from service.config import ServeConfig
from service.embeddings import is_matryoshka
from service.state import ServerState
from tests.batch_support import read_output
from tests.conftest import PROMPTS
from tests.test_commands import synapse

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

LONG = "word " * 1000


def module_config(store_root: str, runtime_dir: str) -> ModuleConfig:
    return ModuleConfig(
        store_root=store_root, host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
    )


def _gap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


async def test_a_named_prompt_is_the_literal_text_prepended(
    store_root, short_runtime_dir, prompted_model
):
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        named = await mod.embed(["a cat"], model=prompted_model, prompt_name="passage")
        literal = await mod.embed(["passage: a cat"], model=prompted_model, prompt="")
        bare = await mod.embed(["a cat"], model=prompted_model, prompt="")
        given = await mod.embed(["a cat"], model=prompted_model, prompt="passage: ")
    assert named.prompt == "passage: " and literal.prompt == bare.prompt == ""
    assert _gap(named.vectors, literal.vectors) <= 1e-6
    assert _gap(named.vectors, given.vectors) <= 1e-6
    assert _gap(named.vectors, bare.vectors) > 1e-2  # the prompt changes the vector
    # "passage", ":" are the prompt's two tokens, counted per item.
    assert named.usage.total_tokens == literal.usage.total_tokens == bare.usage.total_tokens + 2


async def test_the_default_prompt_applies_when_a_call_names_none(
    store_root, short_runtime_dir, prompted_model
):
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        default = await mod.embed(["a cat", "a dog"], model=prompted_model)
        query = await mod.embed(["a cat", "a dog"], model=prompted_model, prompt_name="query")
        bare = await mod.embed(["a cat", "a dog"], model=prompted_model, prompt="")
    assert default.prompt == "query: "
    assert _gap(default.vectors, query.vectors) <= 1e-6
    assert _gap(default.vectors, bare.vectors) > 1e-2
    assert default.usage.prompt_tokens == bare.usage.prompt_tokens + 2 * 2


async def test_prompt_mistakes_are_typed_and_name_the_prompts(
    store_root, short_runtime_dir, prompted_model
):
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        with pytest.raises(InvalidRequest) as info:
            await mod.embed(["x"], model=prompted_model, prompt_name="document")
        assert "'passage', 'query'" in info.value.message
        assert info.value.details["prompts"] == ["passage", "query"]
        assert info.value.details["param"] == "prompt_name"
        with pytest.raises(InvalidRequest, match="not both"):
            await mod.embed(["x"], model=prompted_model, prompt_name="query", prompt="q: ")
        with pytest.raises(InvalidRequest, match="its prompts: none"):
            await mod.embed(["x"], model="minilm-l6-v2", prompt_name="query")
        # The default embedder declares no prompt: nothing is prepended.
        plain = await mod.embed(["a cat"], model="minilm-l6-v2")
        assert plain.prompt == "" and plain.usage.total_tokens == 4
        assert mod.prompt(prompted_model) == "query: " and mod.prompt() == ""


async def test_a_prompted_input_is_cut_as_a_whole_at_the_limit(
    store_root, short_runtime_dir, prompted_model
):
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        cut = await mod.embed([LONG], model=prompted_model, prompt_name="passage")
        literal = await mod.embed(["passage: " + LONG], model=prompted_model, prompt="")
        tokenizer = await mod.tokenizer(prompted_model)
        # 253 words + [CLS] [SEP] fit the 256-token limit alone, not after a 2-token prompt.
        fits = "word " * 253
        assert (
            await mod.embed([fits], model=prompted_model, prompt="", truncate=False)
        ).usage.total_tokens == 255
        with pytest.raises(InvalidRequest, match="257 tokens, over the limit of 256"):
            await mod.embed([fits], model=prompted_model, prompt_name="passage", truncate=False)
    assert cut.truncated == [True] and cut.usage.total_tokens == 256
    assert _gap(cut.vectors, literal.vectors) <= 1e-6
    ids = tokenizer.encode([LONG], truncate=True, prompt="passage: ").ids[0]
    assert len(ids) == 256 and tokenizer.decode(ids[:4]) == "passage : word"  # prompt kept
    assert tokenizer.decode(ids[-1:], skip_special_tokens=False) == "[SEP]"


async def test_the_bulk_job_prepends_the_prompt_and_records_it(
    store_root, short_runtime_dir, prompted_model, tmp_path
):
    texts = ["a cat sat on the mat", "stock markets fell", LONG]
    src = tmp_path / "c.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    out = tmp_path / "o.parquet"
    cfg = module_config(store_root, short_runtime_dir)
    summary = await run_job(
        JobOptions(
            input=str(src), output=str(out), model=prompted_model, prompt_name="passage", module=cfg
        )
    )
    table, ids = read_output(out)
    assert ids == ["r0", "r1", "r2"]
    got = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    async with Module(cfg) as mod:
        want = await mod.embed(texts, model=prompted_model, prompt_name="passage")
    assert np.abs(got - want.vectors).max() < 5e-4  # batch composition moves f16 last bits
    assert table.column("n_tokens").to_pylist()[2] == 256
    assert summary.tokens == want.usage.total_tokens
    assert read_metadata(out)["prompt"] == "passage: "


def test_models_ingested_with_matryoshka_dims_are_matryoshka_to_the_service(
    store_root, prompted_model
):
    state = ServerState(ServeConfig(install_defaults=False))
    state.module = Module(ModuleConfig(store_root=store_root))
    assert state.module.record(prompted_model).manifest.matryoshka_dims == [256, 128]
    assert is_matryoshka(state, prompted_model)
    assert not is_matryoshka(state, "minilm-l6-v2")  # no widths in its manifest
    listed = ServerState(ServeConfig(install_defaults=False, matryoshka_models=["minilm-l6-v2"]))
    listed.module = state.module
    assert is_matryoshka(listed, "minilm-l6-v2")  # the config still adds models


# ---- the command line ------------------------------------------------------------------------


def test_embed_prompt_flags(synapse_cache_dir, prompted_model):
    def run(*flags: str) -> dict:
        proc = synapse(
            synapse_cache_dir, "embed", "--json", "--model", prompted_model, *flags, "a cat"
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    default, passage, literal = run(), run("--prompt-name", "passage"), run("--prompt", "")
    assert default["prompt"] == "query: " and passage["prompt"] == "passage: "
    assert literal["prompt"] == ""
    assert passage["usage"]["total_tokens"] == literal["usage"]["total_tokens"] + 2
    proc = synapse(
        synapse_cache_dir, "embed", "--model", prompted_model, "--prompt-name", "nope", "x"
    )
    assert proc.returncode == 2 and "error[invalid_request]" in proc.stderr
    assert "'passage', 'query'" in " ".join(proc.stderr.split())
    both = synapse(synapse_cache_dir, "embed", "--prompt-name", "q", "--prompt", "", "x")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_models_ls_shows_prompts_and_matryoshka_dims(synapse_cache_dir, prompted_model):
    proc = synapse(synapse_cache_dir, "models", "ls", "--json")
    assert proc.returncode == 0, proc.stderr
    models = {m["name"]: m for m in json.loads(proc.stdout)}
    got = models[prompted_model]
    assert got["prompts"] == PROMPTS and got["default_prompt_name"] == "query"
    assert got["matryoshka_dims"] == [256, 128]
    plain = models["minilm-l6-v2"]  # the fields are there on every model, empty or not
    assert (plain["prompts"], plain["default_prompt_name"], plain["matryoshka_dims"]) == (
        {},
        None,
        [],
    )
    table = " ".join(synapse(synapse_cache_dir, "models", "ls").stdout.split())
    assert f"{prompted_model}: prompts passage, query (default); Matryoshka dims 256,128" in table


def test_models_ingest_prompt_flags(tmp_path):
    from tests.conftest import write_prompted_dir

    src = write_prompted_dir(tmp_path / "e5-style")
    cache = tmp_path / "cache"
    proc = synapse(
        cache,
        "models",
        "ingest",
        str(src),
        "--name",
        "e5",
        "--dtype",
        "f16",
        "--prompt",
        "query=search_query: ",
        "--prompt",
        "document=",
        "--default-prompt",
        "document",
        "--matryoshka-dims",
        "128,256",
    )
    assert proc.returncode == 0, proc.stderr
    man = json.loads((cache / "models" / "e5" / "manifest.json").read_text())
    assert man["prompts"] == {"query": "search_query: ", "passage": "passage: ", "document": ""}
    assert man["default_prompt_name"] == "document" and man["matryoshka_dims"] == [256, 128]
    for flags, says in [
        (["--default-prompt", "nope"], "default prompt 'nope' is not one of"),
        (["--matryoshka-dims", "512"], "Matryoshka dims [512] exceed the model's 384 dims"),
        (["--matryoshka-dims", "256,256"], "Matryoshka dims [256, 256] name a width twice"),
    ]:
        bad = synapse(
            cache, "models", "ingest", str(src), "--name", "bad", "--dtype", "f16", *flags
        )
        assert bad.returncode == 2, bad.stderr
        assert f"error[invalid_request]: {says}" in " ".join(bad.stderr.split())
    for flags in (["--prompt", "no-equals"], ["--matryoshka-dims", "a,b"]):
        usage = synapse(cache, "models", "ingest", str(src), *flags)
        assert usage.returncode == 2 and "expected" in usage.stderr
    assert sorted(p.name for p in (cache / "models").iterdir() if p.name[0] != ".") == ["e5"]
