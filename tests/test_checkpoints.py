"""Checkpoints in and out: sharded HF, Orbax round trip, HF export, the CLI, errors."""

from __future__ import annotations

import glob
import json
import os
import pickle
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from _hf_models import (make_hf_model, random_tokens, rel_err, torch_logits,
                        write_tokenizer)
from checkpoints_conversion.__main__ import main as convert
from specjax import Decoder, Model, ModelConfig, export_hf, load, logits, save_orbax
from specjax._src.models.hf import from_hf_config, to_hf_config

MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gpt2"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def hf_dirs(root):
    """One tiny HF model per layout (Qwen3 tied, with a tokenizer.json)."""
    out = {}
    for mt in MODEL_TYPES:
        extra = dict(tie_word_embeddings=True) if mt == "qwen3" else {}
        directory, torch_model = make_hf_model(mt, root, **extra)
        out[mt] = (directory, torch_model)
    write_tokenizer(out["qwen3"][0], 128)
    return out


def _same_params(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=str(path))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


# --------------------------------------------------------------------------- #
# Round trips
# --------------------------------------------------------------------------- #


def test_sharded_safetensors_load_like_a_single_file(root, hf_dirs):
    _, torch_model = hf_dirs["llama"]
    sharded = os.path.join(str(root), "llama-sharded")
    torch_model.save_pretrained(sharded, max_shard_size="20KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len(glob.glob(os.path.join(sharded, "*.safetensors"))) > 2
    _same_params(load(sharded).params, load(hf_dirs["llama"][0]).params)


def test_hf_to_orbax_to_load_round_trip(root, hf_dirs):
    src, torch_model = hf_dirs["qwen3"]
    out = os.path.join(str(root), "qwen3-orbax")
    assert convert(["to-orbax", src, out]) == 0
    from_hf, from_orbax = load(src), load(out)
    assert from_orbax.module == from_hf.module
    _same_params(from_orbax.params, from_hf.params)
    tokens = random_tokens(128, 2, 10, seed=7)
    np.testing.assert_array_equal(logits(from_orbax, tokens), logits(from_hf, tokens))
    assert rel_err(logits(from_orbax, tokens), torch_logits(torch_model, tokens)) <= 1e-4
    # The tokenizer travels with the checkpoint.
    text = "w1 w5 w42"
    assert from_orbax.tokenizer.encode(text).ids == from_hf.tokenizer.encode(text).ids == [1, 5, 42]
    # A bfloat16 conversion stores bfloat16 params.
    out16 = os.path.join(str(root), "qwen3-orbax-bf16")
    assert convert(["to-orbax", src, out16, "--dtype", "bfloat16"]) == 0
    for bf16 in (load(out16), load(out, dtype="bfloat16")):
        assert bf16.module.config.dtype == "bfloat16"
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16.params))
    _same_params(load(out, dtype=jnp.bfloat16).params, load(out16).params)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_export_hf_loads_in_transformers_with_equal_logits(root, hf_dirs, model_type):
    from transformers import AutoModelForCausalLM

    src, torch_model = hf_dirs[model_type]
    out = os.path.join(str(root), f"{model_type}-export")
    export_hf(load(src), out)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(torch_model)
    tokens = random_tokens(128, 2, 20, seed=8)
    # The same weights in the same architecture: PyTorch gives the same logits.
    assert rel_err(torch_logits(reloaded, tokens), torch_logits(torch_model, tokens)) <= 1e-6
    assert from_hf_config(json.load(open(os.path.join(out, "config.json")))) == load(src).module.config
    if model_type == "qwen3":
        assert os.path.exists(os.path.join(out, "tokenizer.json"))


def test_model_trained_from_scratch_exports_to_transformers(root):
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig("llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=1, head_dim=8, intermediate_size=48, tie_word_embeddings=True)
    module = Decoder(cfg)
    model = Model(params=module.init(jax.random.key(3)), module=module)
    out = os.path.join(str(root), "scratch-hf")
    export_hf(model, out)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = random_tokens(64, 2, 9, seed=9)
    assert rel_err(logits(model, tokens), torch_logits(reloaded, tokens)) <= 1e-4


def test_cli_to_hf_from_orbax_in_bfloat16(root, hf_dirs):
    import torch
    from transformers import AutoModelForCausalLM

    src, torch_model = hf_dirs["gpt2"]
    orbax_dir = os.path.join(str(root), "gpt2-orbax")
    out = os.path.join(str(root), "gpt2-orbax-hf-bf16")
    assert convert(["to-orbax", src, orbax_dir]) == 0
    assert convert(["to-hf", orbax_dir, out, "--dtype", "bfloat16"]) == 0
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.dtype == torch.bfloat16
    # Exactly PyTorch's own float32 -> bfloat16 rounding of every weight.
    want = {k: v.to(torch.bfloat16) for k, v in torch_model.state_dict().items()}
    got = reloaded.state_dict()
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


@pytest.mark.parametrize("src", ["specjax/assets/models/target", "embedded-target"])
def test_cli_converts_whatever_load_reads(tmp_path, src):
    """A shipped directory whose files are xz-packed, or a known name, converts like any checkpoint."""
    import numpy as np

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, src) if "/" in src else src
    assert convert(["to-hf", path, str(tmp_path / "hf")]) == 0
    assert convert(["to-orbax", path, str(tmp_path / "orbax")]) == 0
    ids = [[5, 17, 3, 40, 2]]
    want = np.asarray(logits(load("embedded-target"), ids))
    for out in ("hf", "orbax"):
        np.testing.assert_array_equal(np.asarray(logits(load(str(tmp_path / out)), ids)), want)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_config_round_trips_through_hf(hf_dirs, model_type):
    cfg = from_hf_config(json.load(open(os.path.join(hf_dirs[model_type][0], "config.json"))))
    assert from_hf_config(to_hf_config(cfg)) == cfg
    llama3 = ModelConfig("llama", 64, 32, 2, 4, 2, 8, 48, rope_scaling=from_hf_config({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 48,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    }).rope_scaling)
    assert from_hf_config(to_hf_config(llama3)) == llama3


def test_cli_help_explains_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        convert(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for needle in ("to-orbax", "to-hf", "safetensors", "pickle", "llama, mistral, qwen2, qwen3, gpt2"):
        assert needle in text.lower()


# --------------------------------------------------------------------------- #
# Errors that name the problem
# --------------------------------------------------------------------------- #


def _edit_config(directory, **changes):
    file = os.path.join(directory, "config.json")
    cfg = json.load(open(file))
    cfg.update(changes)
    json.dump(cfg, open(file, "w"))


def _edit_tensors(directory, edit):
    file = os.path.join(directory, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_unknown_model_type_lists_supported(tmp_path, hf_dirs):
    d = _copy(hf_dirs["llama"][0], tmp_path / "m")
    _edit_config(d, model_type="bert")
    with pytest.raises(ValueError, match=r"model_type 'bert'.*llama, mistral, qwen2, qwen3, gpt2"):
        load(d)


def test_missing_tensor_is_named(tmp_path, hf_dirs):
    d = _copy(hf_dirs["llama"][0], tmp_path / "m")
    _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load(d)


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path, hf_dirs):
    d = _copy(hf_dirs["llama"][0], tmp_path / "m")
    name = "model.layers.0.self_attn.k_proj.weight"
    _edit_tensors(d, lambda t: t.__setitem__(name, np.zeros((32, 32), np.float32)))
    with pytest.raises(ValueError, match=rf"'{name}'.*shape \(32, 32\).*implies \(16, 32\)"):
        load(d)


def test_unexpected_tensor_is_named(tmp_path, hf_dirs):
    d = _copy(hf_dirs["llama"][0], tmp_path / "m")
    _edit_tensors(d, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.bias", np.zeros(64, np.float32)))
    with pytest.raises(ValueError, match=r"does not use: 'model\.layers\.0\.mlp\.up_proj\.bias'"):
        load(d)


class _Payload:
    """Unpickling this runs code: it creates a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_only_directory_is_refused_without_unpickling(tmp_path, hf_dirs, capsys):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(os.path.join(hf_dirs["llama"][0], "config.json"), d)
    marker = tmp_path / "pwned"
    with open(d / "pytorch_model.bin", "wb") as f:
        pickle.dump(_Payload(str(marker)), f)
    with pytest.raises(ValueError, match=r"pickle.*execute arbitrary code.*safe_serialization=True"):
        load(str(d))
    assert convert(["to-orbax", str(d), str(tmp_path / "out")]) == 2
    assert "pytorch_model.bin" in capsys.readouterr().err
    assert not marker.exists()


def test_unsupported_rope_scaling_is_named(tmp_path, hf_dirs):
    d = _copy(hf_dirs["llama"][0], tmp_path / "m")
    _edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"rope scaling type 'yarn'.*default, llama3"):
        load(d)


def test_qwen_per_layer_sliding_window_is_refused(tmp_path, hf_dirs):
    d = _copy(hf_dirs["qwen2"][0], tmp_path / "m")
    _edit_config(d, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                 layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        load(d)


@pytest.fixture(scope="module")
def orbax_dir(root, hf_dirs):
    out = os.path.join(str(root), "llama-orbax")
    save_orbax(load(hf_dirs["llama"][0]), out)
    return out


def test_orbax_without_its_config_is_reported_truncated(tmp_path, orbax_dir):
    d = _copy(orbax_dir, tmp_path / "o")
    os.remove(os.path.join(d, "specjax_config.json"))
    with pytest.raises(ValueError, match=r"truncated.*no specjax_config\.json"):
        load(d)


def test_orbax_with_truncated_data_files_is_refused(tmp_path, orbax_dir):
    d = _copy(orbax_dir, tmp_path / "o")
    data = [f for f in glob.glob(os.path.join(d, "params", "**", "d", "*"), recursive=True)
            if os.path.isfile(f)]
    assert data
    for f in data:
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load(d)


def test_orbax_with_missing_params_dir_is_refused(tmp_path, orbax_dir):
    d = _copy(orbax_dir, tmp_path / "o")
    shutil.rmtree(os.path.join(d, "params"))
    with pytest.raises(ValueError, match=r"truncated: no params/"):
        load(d)


def test_orbax_with_a_flipped_byte_is_refused(tmp_path, orbax_dir):
    d = _copy(orbax_dir, tmp_path / "o")
    # Orbax itself reads such damage back silently; the stored checksums catch it.
    biggest = max((f for f in glob.glob(os.path.join(d, "params", "**", "d", "*"), recursive=True)
                   if os.path.isfile(f)), key=os.path.getsize)
    blob = bytearray(open(biggest, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    open(biggest, "wb").write(bytes(blob))
    with pytest.raises(ValueError, match=r"corrupted: param\(s\) .* do not match the checksums"):
        load(d)


def test_orbax_with_a_damaged_config_is_refused(tmp_path, orbax_dir):
    d = _copy(orbax_dir, tmp_path / "o")
    file = os.path.join(d, "specjax_config.json")
    text = open(file).read()
    open(file, "w").write(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"unreadable specjax_config\.json"):
        load(d)


def test_save_orbax_refuses_a_non_empty_directory(orbax_dir):
    with pytest.raises(ValueError, match="non-empty directory"):
        save_orbax(load(orbax_dir), orbax_dir)


def test_missing_directory_and_bad_token_ids(tmp_path, orbax_dir):
    with pytest.raises(ValueError, match="does not exist"):
        load(str(tmp_path / "nowhere"))
    model = load(orbax_dir)
    with pytest.raises(ValueError, match="equal length"):
        logits(model, [[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 128\)"):
        logits(model, [[1, 2, 128]])


def test_export_refuses_configs_hf_cannot_express(tmp_path):
    cfg = ModelConfig("llama", 64, 32, 1, 4, 4, 8, 48, sliding_window=8)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), Decoder(cfg).param_shapes())
    model = Model(params=zeros, module=Decoder(cfg))
    with pytest.raises(ValueError, match="cannot be written as a Hugging Face LlamaForCausalLM.*sliding_window"):
        export_hf(model, str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("model_type,field", [
    ("llama", "hidden_size"), ("llama", "num_hidden_layers"), ("llama", "vocab_size"),
    ("gpt2", "n_embd"), ("gpt2", "n_positions"),
])
def test_config_missing_a_required_field_names_it_and_the_file(tmp_path, hf_dirs, model_type, field):
    d = _copy(hf_dirs[model_type][0], tmp_path / "m")
    file = os.path.join(d, "config.json")
    cfg = json.load(open(file))
    del cfg[field]
    json.dump(cfg, open(file, "w"))
    with pytest.raises(ValueError, match=rf"{file}.*'{field}'") as err:
        load(d)
    assert "KeyError" not in str(err.value)


def test_config_with_invalid_json_names_the_file(tmp_path, hf_dirs):
    d = _copy(hf_dirs["llama"][0], tmp_path / "m")
    file = os.path.join(d, "config.json")
    text = open(file).read()
    open(file, "w").write(text[: len(text) // 2])
    with pytest.raises(ValueError, match=rf"{file} is not valid JSON"):
        load(d)


def test_truncated_safetensors_names_the_file(tmp_path, hf_dirs):
    d = _copy(hf_dirs["llama"][0], tmp_path / "m")
    file = os.path.join(d, "model.safetensors")
    with open(file, "r+b") as fh:
        fh.truncate(os.path.getsize(file) - 100)
    with pytest.raises(ValueError, match=rf"{file} is truncated or corrupt"):
        load(d)
    with open(file, "r+b") as fh:  # now even the header is cut
        fh.truncate(20)
    with pytest.raises(ValueError, match=rf"{file} is truncated or corrupt"):
        load(d)


def test_invalid_shard_index_names_the_file(tmp_path, hf_dirs):
    d = _copy(hf_dirs["llama"][0], tmp_path / "m")
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "model-00001-of-00001.safetensors"))
    index = os.path.join(d, "model.safetensors.index.json")
    open(index, "w").write('{"metadata": {}}')
    with pytest.raises(ValueError, match=rf"{index}.*weight_map"):
        load(d)
    open(index, "w").write('{"weight_map": ')
    with pytest.raises(ValueError, match=rf"{index} is not valid JSON"):
        load(d)


def test_a_single_file_wins_over_stale_shards_as_in_transformers(tmp_path, hf_dirs):
    """model.safetensors beside an index and its shards: transformers loads the single
    file, so specjax does too, and the stale shards change nothing."""
    directory, torch_model = hf_dirs["llama"]
    d = _copy(directory, tmp_path / "m")
    stale = type(torch_model)(torch_model.config)  # other random weights, sharded into the same directory
    stale.save_pretrained(tmp_path / "stale", max_shard_size="20KB")
    for f in glob.glob(str(tmp_path / "stale" / "model*.safetensors*")):
        shutil.copy(f, d)
    assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    _same_params(load(d).params, load(directory).params)


def test_a_tensor_in_two_weight_files_is_refused(tmp_path, hf_dirs):
    """Without model.safetensors or an index every *.safetensors is read; a tensor
    in two of them would otherwise be taken from whichever file sorts last."""
    d = _copy(hf_dirs["llama"][0], tmp_path / "m")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors = load_file(os.path.join(d, "model.safetensors"))
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "weights.safetensors"))
    save_file({name: np.zeros_like(tensors[name])}, os.path.join(d, "zz-stale.safetensors"))
    with pytest.raises(ValueError, match=rf"'{name}' appears more than once"):
        load(d)


def test_an_export_gives_transformers_the_special_tokens(tmp_path):
    """transformers reads BOS / EOS / PAD from tokenizer_config.json, not config.json."""
    from transformers import AutoTokenizer

    model = load("embedded-target")
    export_hf(model, str(tmp_path / "out"))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    config = model.module.config
    assert tokenizer.eos_token_id == config.eos_token_id and tokenizer.bos_token_id == config.bos_token_id
    assert tokenizer.eos_token == model.tokenizer.id_to_token(config.eos_token_id)
    _same_params(load(str(tmp_path / "out")).params, model.params)


def test_a_damaged_tokenizer_file_is_named(tmp_path, hf_dirs):
    d = _copy(hf_dirs["qwen3"][0], tmp_path / "m")
    file = os.path.join(d, "tokenizer.json")
    with open(file, "r+b") as fh:
        fh.truncate(50)
    with pytest.raises(ValueError, match=rf"{file} cannot be read as a tokenizer"):
        load(d)
