"""The presets: sahajBERT's whole run (its data loading through the Hub with current
``datasets``, served by the fake Hub), and the optimizer/collaboration recipes."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kit.config import RunConfig
from kit.config.run import RECIPES, SAHAJBERT_WEB, SAHAJBERT_WIKIPEDIA
from kit.errors import ConfigError


def test_sahajbert_is_the_seed_recipe() -> None:
    config = RunConfig.sahajbert()
    model, optimizer, collaboration = config.model, config.optimizer, config.collaboration
    assert (model.hidden_size, model.num_hidden_layers, model.vocab_size) == (1024, 24, 32_000)
    assert optimizer.name == "lamb" and optimizer.lamb_debias and optimizer.lr == 0.00176
    assert optimizer.betas == (0.9, 0.999) and optimizer.weight_decay == 0.01
    assert optimizer.lamb_clamp_value == 10_000.0 and optimizer.clip_grad_norm == 1.0
    assert (optimizer.warmup_steps, optimizer.total_steps) == (5_000, 1_000_000)
    assert collaboration.target_batch_size == 4_096 and collaboration.target_group_size == 256
    wiki, web = config.data.sources
    assert (wiki.path, wiki.subset, wiki.probability) == (*SAHAJBERT_WIKIPEDIA, 0.23)
    assert (web.path, web.subset, web.probability) == (*SAHAJBERT_WEB, 0.77)
    assert config.tokenizer.train_sources == ("web",)  # as sahajBERT trained it on OSCAR only
    assert RunConfig.from_dict(config.to_dict()) == config


def test_the_ttt_recipe_applies_to_any_model() -> None:
    for base in (RunConfig.sahajbert(), RunConfig.tiny_demo()):
        ttt = base.with_recipe("ttt")
        assert ttt.model == base.model and ttt.data == base.data
        assert ttt.collaboration.run_id == base.collaboration.run_id
        optimizer, collaboration = ttt.optimizer, ttt.collaboration
        assert optimizer.name == "lamb8bit" and not optimizer.lamb_debias
        assert (optimizer.lr, optimizer.betas, optimizer.weight_decay) == (
            0.0025,
            (0.9, 0.96),
            0.045,
        )
        assert optimizer.max_grad_norm == 4.0 and optimizer.clip_grad_norm is None
        assert (optimizer.warmup_steps, optimizer.total_steps) == (3_125, 31_250)
        assert collaboration.grad_compression == collaboration.state_compression == "size_adaptive"
        assert collaboration.size_adaptive_threshold == 2**16 + 1
        assert collaboration.delay_optimizer_step and collaboration.reuse_grad_buffers
        assert collaboration.offload_optimizer and not collaboration.delay_grad_averaging
        assert ttt.with_recipe("sahajbert").optimizer == RunConfig().optimizer
    assert set(RECIPES) == {"sahajbert", "ttt"}
    with pytest.raises(ConfigError, match="help:"):
        RunConfig().with_recipe("gpt")


def test_offload_is_a_peer_local_choice() -> None:
    config = RunConfig.sahajbert()
    import dataclasses

    offloaded = dataclasses.replace(
        config, collaboration=dataclasses.replace(config.collaboration, offload_optimizer=True)
    )
    assert offloaded.config_hash() == config.config_hash()
    delayed = dataclasses.replace(
        config, collaboration=dataclasses.replace(config.collaboration, delay_optimizer_step=True)
    )
    assert delayed.config_hash() != config.config_hash()


def parquet(texts: list[str]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    table = pa.table({"id": [str(i) for i in range(len(texts))], "text": texts})
    pq.write_table(table, buffer)
    return buffer.getvalue()


def card(configs: dict[str, dict[str, str]], license: str) -> bytes:
    """A dataset card whose YAML maps configs to data files, as the Hub's parquet datasets do."""
    lines = ["---", f"license: {license}", "configs:"]
    for name, splits in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {path}" for split, path in splits.items()]
    return ("\n".join([*lines, "---", "# test copy"]) + "\n").encode()


@pytest.mark.sockets
def test_sahajbert_data_loads_with_current_datasets_from_the_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The preset's own sources, served by the fake Hub under the real repo names and layouts
    (no loading script: plain parquet described by the card), through kit's pipeline."""
    import dataclasses

    import datasets.config

    from kit.data.pipeline import PretrainingPipeline
    from kit.data.synthetic import SyntheticBengali
    from kit.data.tokenizer import train_tokenizer
    from kit.testing.fake_hub import FakeHub

    generator = SyntheticBengali(seed=3)
    wiki_texts = list(generator.documents(60, min_sentences=3, max_sentences=8))
    web_texts = list(generator.documents(60, min_sentences=3, max_sentences=8))
    config = RunConfig.sahajbert()
    wiki_path, wiki_subset = SAHAJBERT_WIKIPEDIA
    web_path, web_subset = SAHAJBERT_WEB
    with FakeHub() as hub, hub.patched_client(tmp_path / "hf_home"):
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", hub.endpoint)
        hub.create_repo(wiki_path, repo_type="dataset")
        hub.commit(
            wiki_path,
            {
                "README.md": card(
                    {wiki_subset: {"train": f"{wiki_subset}/train-*"}}, "cc-by-sa-3.0"
                ),
                f"{wiki_subset}/train-00000-of-00001.parquet": parquet(wiki_texts),
                "20231101.en/train-00000-of-00001.parquet": parquet(["an English page"] * 3),
            },
            "add wikipedia",
            repo_type="dataset",
        )
        hub.create_repo(web_path, repo_type="dataset")
        hub.commit(
            web_path,
            {
                "README.md": card(
                    {
                        web_subset: {
                            "train": f"data/{web_subset}/train/*",
                            "test": f"data/{web_subset}/test/*",
                        }
                    },
                    "odc-by",
                ),
                f"data/{web_subset}/train/000_00000.parquet": parquet(web_texts),
                f"data/{web_subset}/test/000_00000.parquet": parquet(["পরীক্ষা"] * 3),
            },
            "add fineweb-2",
            repo_type="dataset",
        )
        tokenizer = train_tokenizer(
            wiki_texts + web_texts,
            dataclasses.replace(config.tokenizer, vocab_size=400),
            progress=False,
        )
        data = dataclasses.replace(
            config.data, max_seq_length=64, shuffle_buffer_size=20, tokenize_batch_size=8
        )
        pipeline = PretrainingPipeline.from_config(data, tokenizer, peer_identity=b"volunteer")
        batches = pipeline.batches(4)
        for _ in range(10):
            batch = next(batches)
            assert batch["input_ids"].shape[0] == 4
        wiki, web = pipeline.statistics().sources
        assert wiki.name == "wiki" and web.name == "web"
        assert wiki.used > 0 and web.used > 0  # both sources stream
        assert web.used > wiki.used  # 0.77 against 0.23
        # It all came through the (fake) Hub: both configs' parquet files, not the English one.
        fetched = {r.path for r in hub.requests if r.path.endswith(".parquet")}
        assert any(f"{wiki_subset}/train-" in path for path in fetched)
        assert any(f"data/{web_subset}/train/" in path for path in fetched)
        assert not any("20231101.en" in path for path in fetched)
