"""Matryoshka widths read from a model's own files at ingest (formats/matryoshka.py): config.json's
`matryoshka_dimensions`, and the MatryoshkaLoss parameters of the card sentence-transformers
writes after training; the widths given at ingest win; files that disagree are refused."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from common.errors import ArtifactInvalid
from ingest.encode_options import encode_options

LOSS_LINK = "https://sbert.net/docs/package_reference/sentence_transformer/losses.html"


def card(*dims: list[int]) -> str:
    """A model card with one training dataset per `dims`, its loss block rendered as
    sentence-transformers' model_card.py renders it (json.dumps indent 4, indented 2 under the
    list item), beside a usage example in JSON that is no loss's."""
    parts = ["---\nlibrary_name: sentence-transformers\n---\n", '```json\n{"input": "hi"}\n```\n']
    for widths in dims:
        config = {
            "loss": "MultipleNegativesRankingLoss",
            "matryoshka_dims": widths,
            "matryoshka_weights": [1] * len(widths),
            "n_dims_per_step": -1,
        }
        block = textwrap.indent(f"```json\n{json.dumps(config, indent=4)}\n```", "  ")
        parts.append(
            f"* Loss: [<code>MatryoshkaLoss</code>]({LOSS_LINK}#matryoshkaloss) with these "
            f"parameters:\n{block}\n"
        )
    return "\n".join(parts)


def model_dir(tmp: Path, readme: str | None = None, config_dims: list[int] | None = None) -> Path:
    tmp.mkdir()
    config = {"model_type": "bert", "hidden_size": 96}
    if config_dims is not None:
        config["matryoshka_dimensions"] = config_dims
    (tmp / "config.json").write_text(json.dumps(config))
    if readme is not None:
        (tmp / "README.md").write_text(readme)
    return tmp


def test_widths_come_from_the_card_or_the_config_and_given_ones_win(tmp_path):
    from_card = model_dir(tmp_path / "card", card([32, 96, 64], [96, 64, 32]))
    assert encode_options(from_card).matryoshka_dims == [96, 64, 32]
    # jina-embeddings-v3 keeps them in its config, narrowest first.
    from_config = model_dir(tmp_path / "config", config_dims=[32, 64, 96])
    assert encode_options(from_config).matryoshka_dims == [96, 64, 32]
    both = model_dir(tmp_path / "both", card([96, 32]), config_dims=[32, 96])
    assert encode_options(both).matryoshka_dims == [96, 32]
    # A card without a Matryoshka loss, or no card: none.
    assert encode_options(model_dir(tmp_path / "plain", card())).matryoshka_dims == []
    # Given at ingest: those, whatever the files say.
    given = encode_options(from_card, matryoshka_dims=[48])
    assert given.matryoshka_dims == [48] and given.asked


@pytest.mark.parametrize(
    "readme, config_dims, says",
    [
        (card([96, 64], [96, 32]), None, "different Matryoshka widths per dataset"),
        (card([96, 64]), [96, 32], "the model's files disagree on its Matryoshka widths"),
        (None, [96, 0], "must be a list of positive widths"),
        (None, [64, 64], "names a width twice"),
    ],
)
def test_widths_the_files_cannot_settle_are_refused_unless_ingest_names_them(
    tmp_path, readme, config_dims, says
):
    d = model_dir(tmp_path / "m", readme, config_dims)
    with pytest.raises(ArtifactInvalid, match=says) as e:
        encode_options(d)
    assert "--matryoshka-dims" in e.value.message
    assert encode_options(d, matryoshka_dims=[64]).matryoshka_dims == [64]


@pytest.mark.model
def test_a_pulled_card_s_widths_reach_the_manifest(tmp_path):
    """Through a real conversion: what the store records (and the service reads)."""
    from ingest.store import ArtifactStore
    from tests.hub_support import tiny_bert_dir

    src = tiny_bert_dir(tmp_path / "tiny")
    (src / "README.md").write_text(card([96, 48, 24]))
    rec = ArtifactStore(tmp_path / "store").ingest_hf_dir(src, name="tiny", dtype="f32")
    assert rec.manifest.matryoshka_dims == [96, 48, 24]
