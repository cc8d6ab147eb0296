"""kvp-admin: identity resolution, refusals, diff, and status without a server."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvpersist.admin.cli import main
from kvpersist.admin.pins_writer import TOKENIZER_FILES
from kvpersist.demo.tiny_model import build_tiny_model
from kvpersist.identity import load_pins
from kvpersist.testing.helpers import TINY_PINS, write_pins

REVISION = load_pins(TINY_PINS)["model_revision"]


@functools.cache
def _built_tiny_model() -> Path:
    return build_tiny_model(Path(tempfile.mkdtemp(prefix="kvp-tiny-")))


def tiny_folder(root: Path) -> Path:
    """A copy of the tiny model's folder (the identity digests every file of it)."""
    built = _built_tiny_model()
    snap = root / "models--kvpersist--tiny-llama" / "snapshots" / REVISION
    shutil.copytree(built, snap)
    return snap


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_identity_pins_and_folder_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny_folder(tmp_path)
    code, out, _ = run(capsys, "identity", "--pins", str(TINY_PINS), "--model-folder", str(folder),
                       "--block-size", "128", "--tensor-parallel-size", "1",
                       "--pipeline-parallel-size", "1", "--json")
    data = json.loads(out)
    assert code == 0 and data["enabled"]
    assert data["namespace"].startswith("kvp-") and len(data["namespace"]) == 36
    assert data["lmcache_model_name"] == f"kvpersist/tiny-llama/{data['namespace']}"
    assert data["sources"]["model_revision"] == "both"


def test_identity_disagreement_is_exit_3_naming_field(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny_folder(tmp_path)
    code, out, _ = run(capsys, "identity", "--pins", str(TINY_PINS), "--model-folder", str(folder),
                       "--block-size", "64")
    assert code == 3
    assert "caching OFF" in out and "block_size" in out and "pinned 128" in out


def test_identity_incomplete_pins_is_exit_3(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "identity", "--pins", str(TINY_PINS), "--json")
    data = json.loads(out)
    assert code == 3 and not data["enabled"]
    assert any("build" in p for p in data["problems"])


def test_identity_bad_pins_file_is_an_error(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.env"
    bad.write_text("KVP_MODEL=foo\n")
    code, _, err = run(capsys, "identity", "--pins", str(bad))
    assert code == 1 and "unknown key 'KVP_MODEL'" in err
    code, _, err = run(capsys, "identity", "--pins", str(tmp_path / "missing.env"))
    assert code == 1 and "cannot read" in err


def test_identity_diff_explains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = write_pins(tmp_path / "other.env", tensor_parallel_size="4", block_size="16")
    code, out, _ = run(capsys, "identity", "diff", str(TINY_PINS), str(other), "--json")
    data = json.loads(out)
    assert code == 0 and not data["same"]
    assert {d["field"] for d in data["differences"]} == {"tensor_parallel_size", "block_size"}
    code, out, _ = run(capsys, "identity", "diff", str(TINY_PINS), str(TINY_PINS))
    assert "share KV" in out
    code, words, _ = run(capsys, "identity", "diff", str(TINY_PINS), str(other), "--json")
    assert code == 0 and json.loads(words) == data
    code, _, err = run(capsys, "identity", "dif", str(TINY_PINS), str(other))
    assert code == 2 and "invalid choice: 'dif'" in err and "diff" in err


@pytest.mark.parametrize(("given", "meant"), [
    (["--pins", "p.env"], ["resolve", "--pins", "p.env"]),
    ([], ["resolve"]),
    (["diff", "a", "b"], ["diff", "a", "b"]),
    (["--help"], ["--help"]),
])
def test_without_a_subcommand_identity_resolves(given: list[str], meant: list[str]) -> None:
    from kvpersist.admin.cli.identity_cmd import identity_argv

    assert identity_argv(given) == meant


def test_a_flag_spelling_of_a_subcommand_is_refused_with_its_name(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "identity", "--diff", str(TINY_PINS), str(TINY_PINS))
    assert code == 2 and "unrecognized arguments: --diff" in err


def test_identity_subcommands_each_teach_their_use(capsys: pytest.CaptureFixture[str]) -> None:
    helps = {}
    for command in ("resolve", "write-pins", "diff", "show", "server"):
        code, helps[command], _ = run(capsys, "identity", command, "--help")
        assert code == 0 and "--json" in helps[command], command
    assert "--vllm-args" in helps["resolve"] and "--vllm-args" in helps["write-pins"]
    assert "-tp" in helps["write-pins"] and "--force" in helps["write-pins"]
    assert "--force" not in helps["resolve"]
    code, top, _ = run(capsys, "identity", "--help")
    assert all(c in top for c in helps)


def test_status_without_server(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVP_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("KVP_HTTP_PORT", "1")
    code, out, _ = run(capsys, "status", "--json")
    data = json.loads(out)
    assert code == 3 and data["healthy"] is False and data["pid_state"] == "absent"


def test_console_entry_point_help() -> None:
    res = subprocess.run([sys.executable, "-m", "kvpersist.admin.cli", "--help"], capture_output=True,
                         text=True, timeout=60, check=True)
    assert "identity" in res.stdout and "status" in res.stdout and "server" in res.stdout


RECIPE = "--dtype float32 --max-model-len 2048 --block-size 128 -tp 1 -pp 1"


def _pins_values(path: Path) -> dict[str, object]:
    return dict(load_pins(path))


def test_write_pins_from_folder_and_recipe_matches_the_shipped_pins(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny_folder(tmp_path)
    target = tmp_path / "identity.env"
    code, out, err = run(capsys, "identity", "write-pins", str(target), "--vllm-args", f"{folder} {RECIPE}")
    assert code == 0, err
    assert _pins_values(target) == _pins_values(TINY_PINS)  # every field, build left out
    text = target.read_text()
    assert "# KVP_BUILD is left to the engine" in text and "\nKVP_BUILD=" not in text
    assert text.count("\n# ") >= 14  # each field carries its explanation
    namespace = out.split("namespace ")[1].strip()
    code, out, _ = run(capsys, "identity", "--pins", str(target), "--model-folder", str(folder),
                       "--json")
    assert code == 0 and json.loads(out)["namespace"] == namespace
    # the same again: unchanged; another recipe: refused without --force, then replaced
    code, out, _ = run(capsys, "identity", "write-pins", str(target), "--vllm-args", f"{folder} {RECIPE}")
    assert code == 0 and out.startswith("unchanged")
    before = target.read_text()
    other = RECIPE.replace("2048", "1024")
    code, _, err = run(capsys, "identity", "write-pins", str(target), "--vllm-args", f"{folder} {other}")
    assert code == 1 and "--force" in err and target.read_text() == before
    code, out, _ = run(capsys, "identity", "write-pins", str(target), "--vllm-args",
                       f"{folder} {other}", "--force")
    assert code == 0 and out.startswith("replaced")
    assert str(_pins_values(target)["max_model_len"]) == "1024"



def test_engine_level_processor_kwargs_are_pinned_and_move_the_namespace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A recipe with ``--mm-processor-kwargs`` pins their digest (and a namespace of its own);
    without them the pins file is what it always was (no line for the field)."""
    folder = tiny_folder(tmp_path)
    plain, tuned = tmp_path / "plain.env", tmp_path / "tuned.env"
    code, out, err = run(capsys, "identity", "write-pins", str(plain), "--vllm-args",
                         f"{folder} {RECIPE}")
    assert code == 0, err
    plain_ns = out.split("namespace ")[1].strip()
    assert "KVP_MM_PROCESSOR_KWARGS_SHA256" not in plain.read_text()
    kwargs = '{"max_pixels": 1000}'
    code, out, err = run(capsys, "identity", "write-pins", str(tuned), "--vllm-args",
                         f"{folder} {RECIPE} --mm-processor-kwargs '{kwargs}'")
    assert code == 0, err
    digest = hashlib.sha256(b'{"max_pixels":1000}').hexdigest()
    assert _pins_values(tuned)["mm_processor_kwargs_sha256"] == digest
    assert out.split("namespace ")[1].strip() != plain_ns

def test_a_recipe_with_a_draft_model_writes_the_same_pins_and_says_the_engine_adds_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``draft_sha256`` is the engine's to compute: the pins leave it out, and a recipe that
    runs a draft model is told that the engine's namespace adds it; n-grams add nothing."""
    folder = tiny_folder(tmp_path)
    plain, drafted = tmp_path / "plain.env", tmp_path / "drafted.env"
    code, out, err = run(capsys, "identity", "write-pins", str(plain), "--vllm-args",
                         f"{folder} {RECIPE}")
    assert code == 0, err
    assert "note:" not in out
    eagle = '{"method": "eagle", "model": "/models/head", "num_speculative_tokens": 2}'
    code, out, err = run(capsys, "identity", "write-pins", str(drafted), "--vllm-args",
                         f"{folder} {RECIPE} --speculative-config '{eagle}'")
    assert code == 0, err
    assert "note:" in out and "draft_sha256" in out
    assert drafted.read_text() == plain.read_text()
    assert "DRAFT" not in drafted.read_text()
    code, out, _ = run(capsys, "identity", "--pins", str(drafted), "--vllm-args",
                       f"{folder} {RECIPE} --speculative-config '{eagle}'", "--json")
    assert code == 0 and any("draft_sha256" in n for n in json.loads(out)["notes"])
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    code, out, _ = run(capsys, "identity", "--pins", str(plain), "--vllm-args",
                       f"{folder} {RECIPE} --speculative-config '{ngram}'", "--json")
    assert code == 0 and json.loads(out)["notes"] == []
    code, _, err = run(capsys, "identity", "--vllm-args",
                       f"{folder} {RECIPE} --speculative-config '[1]'")
    assert code == 1 and "--speculative-config" in err and "JSON object" in err


def test_missing_flag_still_shows_every_resolved_value(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny_folder(tmp_path)
    code, out, _ = run(capsys, "identity", "--model-folder", str(folder), "--block-size", "128",
                       "--tensor-parallel-size", "1", "--max-model-len", "2048")
    assert code == 3
    assert "MISSING (KVP_PP_SIZE)" in out and "'pipeline_parallel_size'" in out
    assert REVISION in out and "float32" in out and "?" not in out
    code, out, _ = run(capsys, "identity", "--model-folder", str(folder), "--block-size", "128",
                       "--json")
    data = json.loads(out)
    assert set(data["missing"]) == {"tensor_parallel_size", "pipeline_parallel_size"}
    assert data["resolved"]["model_revision"] == REVISION and data["namespace"] is None
    target = tmp_path / "incomplete.env"
    code, _, err = run(capsys, "identity", "write-pins", str(target), "--model-folder", str(folder))
    assert code == 1 and "nothing written" in err and "KVP_TP_SIZE" in err
    assert not target.exists()


def test_vllm_args_are_read_like_the_launcher_passes_them(tmp_path: Path) -> None:
    from kvpersist.identity.engine_flags import identity_flags

    flags = identity_flags("/models/m --block-size=16 -tp 4 --pipeline-parallel-size 2 "
                           "--max-model-len 32768 --dtype bfloat16 --chat-template 't m.jinja' "
                           "--gpu-memory-utilization 0.85 --enable-prefix-caching")
    assert (flags.model, flags.block_size, flags.tensor_parallel_size,
            flags.pipeline_parallel_size, flags.max_model_len, flags.dtype,
            flags.chat_template) == ("/models/m", 16, 4, 2, 32768, "bfloat16", "t m.jinja")
    from kvpersist.identity.engine_flags import EngineFlagsError

    with pytest.raises(EngineFlagsError, match="invalid int value: 'sixteen'"):
        identity_flags("--block-size sixteen")


def test_chat_template_from_the_recipe_enters_the_identity(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpersist.identity.sources import chat_template_digest

    folder = tiny_folder(tmp_path)
    template = tmp_path / "custom.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    code, out, _ = run(capsys, "identity", "--vllm-args",
                       f"{folder} {RECIPE} --chat-template {template}", "--json")
    assert code == 0
    assert json.loads(out)["fields"]["chat_template_sha256"] == chat_template_digest(
        template.read_text())


@pytest.mark.parametrize("breakage", ["missing folder", "no tokenizer", "bad template"])
def test_write_pins_refuses_bad_input_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], breakage: str) -> None:
    folder = tiny_folder(tmp_path)
    extra = ""
    if breakage == "missing folder":
        folder = tmp_path / "nowhere"
    elif breakage == "no tokenizer":
        for name in TOKENIZER_FILES:
            (folder / name).unlink(missing_ok=True)
    else:
        broken = tmp_path / "broken.jinja"
        broken.write_text("{% for m in messages %}{{ m['content'] }")
        extra = f" --chat-template {broken}"
    target = tmp_path / "identity.env"
    code, _, err = run(capsys, "identity", "write-pins", str(target), "--vllm-args",
                       f"{RECIPE}{extra}", "--model-folder", str(folder))
    assert code == 1 and not target.exists(), err
    expected = {"missing folder": "cannot read model config", "no tokenizer": "no tokenizer",
                "bad template": "chat template cannot be rendered"}[breakage]
    assert expected in err, err


def test_a_recipe_without_tp_or_pp_takes_vllm_s_defaults(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM runs a recipe without -tp/-pp at 1 and 1; the pins writer reads it the same way
    (they were reported MISSING), and the defaults are vLLM's own."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from kvpersist.identity.engine_flags import VLLM_DEFAULTS

    engine_defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert {name: engine_defaults[name] for name in VLLM_DEFAULTS} == VLLM_DEFAULTS
    folder = tiny_folder(tmp_path)
    target = tmp_path / "identity.env"
    recipe = RECIPE.replace(" -tp 1 -pp 1", "")
    code, _, err = run(capsys, "identity", "write-pins", str(target), "--vllm-args", f"{folder} {recipe}")
    assert code == 0, err
    assert _pins_values(target) == _pins_values(TINY_PINS)
    code, out, _ = run(capsys, "identity", "--vllm-args", f"{folder} {recipe} -tp 2", "--json")
    assert json.loads(out)["fields"]["tensor_parallel_size"] == 2


def test_a_local_folder_gets_a_content_digest_as_its_revision(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder outside the Hugging Face layout is pinned without invented revisions: ids
    ``local/<name>``, revisions a digest of its content; a changed byte changes the namespace."""
    folder = tmp_path / "chat-v2"
    shutil.copytree(tiny_folder(tmp_path / "hf"), folder)
    (folder / "weights.bin").write_bytes(b"w" * 1000)
    target = tmp_path / "local.env"
    code, out, err = run(capsys, "identity", "write-pins", str(target), "--vllm-args",
                         f"{folder} {RECIPE}")
    assert code == 0, err
    assert "not a Hugging Face snapshot" in err and "content digest" in err
    pins = _pins_values(target)
    assert pins["model_id"] == pins["tokenizer_id"] == "local/chat-v2"
    revision = str(pins["model_revision"])
    assert len(revision) == 40 and revision == pins["tokenizer_revision"] != REVISION
    first = out.split("namespace ")[1].strip()
    (folder / "weights.bin").write_bytes(b"w" * 999 + b"x")
    again = tmp_path / "again.env"
    code, out, _ = run(capsys, "identity", "write-pins", str(again), "--vllm-args",
                       f"{folder} {RECIPE}")
    assert code == 0 and _pins_values(again)["model_revision"] != revision
    assert out.split("namespace ")[1].strip() != first
    code, _, _ = run(capsys, "identity", "write-pins", str(tmp_path / "set.env"), "--vllm-args",
                     f"{folder} {RECIPE}", "--set", "model_id=team/chat")
    assert code == 0 and _pins_values(tmp_path / "set.env")["model_id"] == "team/chat"


def test_diff_of_a_pins_file_takes_the_installed_build(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pins file leaves the build to the engine: compared with the fields of a namespace
    written by this installation it is the same, and with another build it differs in build."""
    from kvpersist.identity.sources import build_identity

    installed = build_identity()
    assert installed is not None
    fields = {**load_pins(TINY_PINS), "build": installed}  # the weights left to the engine too
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"fields": fields}))
    code, out, _ = run(capsys, "identity", "diff", str(TINY_PINS), str(same), "--json")
    assert code == 0 and json.loads(out)["same"], out
    older = tmp_path / "older.json"
    older.write_text(json.dumps({"fields": {**json.loads(same.read_text())["fields"],
                                            "build": installed.replace("vllm=", "vllm=0.0.")}}))
    code, out, _ = run(capsys, "identity", "diff", str(TINY_PINS), str(older), "--json")
    assert [d["field"] for d in json.loads(out)["differences"]] == ["build"]
