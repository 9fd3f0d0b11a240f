"""JaggedRows (the rows of a sequence feature), the reference engine's unpooled lookups, and the
models and configs that refuse tables with pooling none."""

from __future__ import annotations

import pytest
import torch

from neorec.config.schema import TableOverride
from neorec.embedding.reference import ReferenceEmbeddingCollection
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.errors import ConfigError
from neorec.model.dlrm import DLRM, DCNv2
from neorec.sparse import JaggedRows, SparseBatch


def test_offsets_and_padding_keep_order():
    values = torch.arange(12, dtype=torch.float32).view(6, 2)  # ids 0..5, row k = [2k, 2k + 1]
    rows = JaggedRows(values, torch.tensor([2, 0, 3, 1]))
    assert rows.offsets().tolist() == [0, 2, 2, 5, 6]
    padded, mask = rows.to_padded()
    assert padded.shape == (4, 3, 2)
    assert mask.tolist() == [[True, True, False], [False] * 3, [True] * 3, [True, False, False]]
    assert padded[2, :, 0].tolist() == [4.0, 6.0, 8.0]
    assert padded[0, 2].tolist() == [0.0, 0.0] and padded[1].abs().sum() == 0


def test_padding_truncates_to_the_last_ids_and_passes_gradients():
    values = torch.randn(7, 3, requires_grad=True)
    rows = JaggedRows(values, torch.tensor([4, 1, 2]))
    padded, mask = rows.to_padded(max_len=2)
    assert padded.shape == (3, 2, 3)
    assert mask.tolist() == [[True, True], [True, False], [True, True]]
    torch.testing.assert_close(padded[0], values[2:4].detach())  # the last two of sample 0
    torch.testing.assert_close(padded[1, 0], values[4].detach())
    torch.testing.assert_close(padded[2], values[5:7].detach())
    padded.sum().backward()
    assert values.grad[:, 0].tolist() == [0, 0, 1, 1, 1, 1, 1]  # cut ids get no gradient
    empty, mask = JaggedRows(torch.zeros(0, 3), torch.zeros(2, dtype=torch.int64)).to_padded()
    assert empty.shape == (2, 0, 3) and mask.shape == (2, 0)


def sequence_tables() -> list[TableConfig]:
    return [
        TableConfig(name="users", rows=10, dim=4, features=["user"]),
        TableConfig(name="history", rows=20, dim=3, features=["clicks", "views"], pooling="none"),
    ]


def test_reference_engine_returns_pooled_and_sequences():
    tables = sequence_tables()
    emb = ReferenceEmbeddingCollection(tables, EmbeddingOptimizerConfig())
    assert emb.feature_names == ["user"] and emb.output_dim == 4
    assert emb.sequence_names == ["clicks", "views"] and emb.sequence_dims == [3, 3]
    batch = SparseBatch.from_features(
        {
            "user": (torch.tensor([1, 2]), torch.tensor([1, 1])),
            "clicks": (torch.tensor([5, 5, 7]), torch.tensor([0, 3]), torch.tensor([1.0, 2.0, 0.5])),
            "views": (torch.tensor([3, 4]), torch.tensor([1, 1])),
        }
    )
    pooled, seqs = emb.embed(batch)
    table = emb.table_weights()["history"]
    assert pooled.shape == (2, 4) and set(seqs) == {"clicks", "views"}
    torch.testing.assert_close(seqs["clicks"].values, table[[5, 5, 7]] * torch.tensor([[1.0], [2.0], [0.5]]))
    assert seqs["clicks"].lengths.tolist() == [0, 3]
    torch.testing.assert_close(emb(batch), pooled)


def test_pooled_models_refuse_sequence_tables():
    from neorec.model.deepfm import DeepFM
    from neorec.model.two_tower import TwoTower

    emb = ReferenceEmbeddingCollection(sequence_tables(), EmbeddingOptimizerConfig())
    with pytest.raises(ConfigError, match=r"dlrm.*\['history'\].*pooling none"):
        DLRM(2, emb, [4], [4])
    with pytest.raises(ConfigError, match=r"dcnv2.*\['history'\].*pooling none"):
        DCNv2(2, emb, [4], [4])
    with pytest.raises(ConfigError, match=r"deepfm.*\['history'\].*pooling none"):
        DeepFM(2, emb, [4], [4])
    with pytest.raises(ConfigError, match=r"two_tower.*\['history'\].*pooling none"):
        TwoTower(emb, ["user"], ["user"], "user", 10, [4], 0.1)


def test_table_override_accepts_pooling_none():
    assert TableOverride(pooling="none").pooling == "none"


def test_config_refuses_pooling_none_for_ranking_models():
    from neorec.config.load import validate_config
    from neorec.errors import ConfigError as Error

    with pytest.raises(Error, match=r"dcnv2 reads pooled embeddings only.*\['C3'\].*pooling none"):
        validate_config({"model": {"arch": "dcnv2"}, "embedding": {"tables": {"C3": {"pooling": "none"}}}})


def test_sequence_tables_refuse_managed_collision():
    from neorec.embedding.fused import FusedEmbeddingCollection
    from neorec.embedding.tables import ManagedCollisionConfig

    table = TableConfig(name="history", rows=8, dim=4, features=["clicks"], pooling="none",
                        managed_collision=ManagedCollisionConfig())  # fmt: skip
    with pytest.raises(ConfigError, match=r"'history': managed_collision is for pooled tables"):
        FusedEmbeddingCollection([table], EmbeddingOptimizerConfig())
