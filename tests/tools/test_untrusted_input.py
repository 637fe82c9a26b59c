"""A Hugging Face folder someone else wrote: config.json with forged field types is one
`convert: error:` line naming the file (weights are safetensors: no pickle at all)."""
import json

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")

from tools.checkpoint import convert  # noqa: E402


@pytest.mark.parametrize("config,needle", [
    ({"model_type": "gpt2", "n_head": "12", "n_layer": 2}, "field 'n_head' is '12'"),
    ({"model_type": "gpt2", "n_head": 2, "n_layer": 10 ** 9}, "field 'n_layer' is 1000000000"),
    ([1, 2], "top level must be a JSON object"),
])
def test_hostile_hf_config(tmp_path, capsys, config, needle):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    rc = convert.main(["--load", str(src), "--save", str(tmp_path / "out"), "--from-hf",
                       "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("convert: error:") and str(src / "config.json") in err and needle in err, err
