"""``python -m attncore``: its options (the demo's numbers are checked in
test_attention_layer and the README test)."""
import os

import pytest

from attncore.__main__ import main


def test_help_and_unknown_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "--no-picture" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # it ran the whole demo, ignoring the option
        main(["--bogus-option"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus-option" in capsys.readouterr().err


def test_config_only(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--config"]) == 0
    out = capsys.readouterr().out
    assert "attncore configuration" in out and "demo:" not in out
    assert os.listdir(tmp_path) == []


def test_demo_without_picture(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--no-picture"]) == 0
    out = capsys.readouterr().out
    assert "demo: causal self-attention" in out and "picture" not in out
    assert os.listdir(tmp_path) == []


def test_picture_path(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sub" / "align.png"
    assert main(["--picture", str(path)]) == 1  # the folder does not exist
    assert "cannot write the picture" in capsys.readouterr().err
    path.parent.mkdir()
    assert main(["--picture", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
