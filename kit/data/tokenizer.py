"""The language-aware tokenizer recipe: build, train, save, load and publish a Unigram tokenizer.

It holds the sahajBERT recipe (DeDLOC, Diskin et al. 2021; HF blog "Deep Learning over the
Internet", section "Tokenizer") as composable ``tokenizers`` parts, with a ``bengali`` preset that
reproduces it and a ``generic`` one without the Bengali-only replacements:

* normalizer: sentencepiece NMT rules, NFKC, runs of spaces collapsed, recurring Bengali Unicode
  variants homogenized, lowercase. Unlike stock ALBERT there is no accent stripping: Bengali
  vowel signs are combining marks, and stripping "accents" would delete vowels.
* pre-tokenizer: Metaspace (``▁`` marks word starts), every digit and every punctuation mark
  isolated, so numbers and dandas don't multiply the vocabulary.
* model: Unigram; special tokens ``<pad> <unk> [CLS] [SEP] [MASK]`` at ids 0-4, ``[MASK]`` strips
  the space on its left; templates ``[CLS] A [SEP]`` and ``[CLS] A [SEP] B [SEP]`` (type ids 0/1).

Training reads the run's text sources once (``open_training_sources``, with the data filters;
sahajBERT trained on OSCAR-bn only). The trained tokenizer is saved as a ``transformers`` fast
tokenizer folder that ``AutoTokenizer.from_pretrained`` loads offline. It doesn't hold how
sources are streamed (kit.data.sources) nor what the pipeline does with token ids
(kit.data.examples).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tqdm.auto import tqdm

from kit.config import DataConfig, TokenizerConfig, config_error
from kit.errors import DataSourceNotFound, DataSourceUnreachable

from .sources import TextSource, derive_seed

logger = logging.getLogger(__name__)

#: Special tokens, in id order; the ids line up with ALBERT's config (pad 0, bos 2, eos 3).
SPECIAL_TOKENS = ("<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))
#: The word-start marker of Metaspace (U+2581).
WORD_START = "\u2581"

#: Bengali homogenization, applied in this order after NFKC (sahajBERT's normalizer steps 4-8).
#: Each entry: (pattern, replacement, pattern_is_regex).
BENGALI_REPLACEMENTS: tuple[tuple[str, str, bool], ...] = (
    ("\u09e4", "\u0964", False),  # unassigned code point used as a danda -> DEVANAGARI DANDA
    ("\u09e5", "\u0965", False),  # unassigned code point used as a double danda -> DOUBLE DANDA
    ("|", "\u0964", False),  # ASCII bar typed for a danda -> DANDA
    ("\u09f7", "\u0964", False),  # BENGALI CURRENCY NUMERATOR FOUR, looks like a danda -> DANDA
    ("(?<=[\u0980-\u09ff]):", "\u0983", True),  # ASCII colon after a Bengali letter -> VISARGA
)

#: Documents per batch handed to the trainer (sahajBERT fed 100; larger batches cut overhead).
TRAIN_BATCH_DOCUMENTS = 1000


def build_normalizer(preset: str = "bengali", lowercase: bool = True) -> normalizers.Normalizer:
    """The normalizer of the recipe (see the module docstring for the steps).

    Args:
        preset: ``"bengali"`` adds the Bengali homogenization replacements; ``"generic"`` doesn't.
        lowercase: fold case last (Bengali has no case; this affects Latin words in the text).
    """
    steps: list[normalizers.Normalizer] = [
        normalizers.Nmt(),  # drops control characters; tabs, newlines, ZWJ/ZWNJ become spaces
        normalizers.NFKC(),
        normalizers.Replace(Regex(" {2,}"), " "),
    ]
    if preset == "bengali":
        for pattern, replacement, is_regex in BENGALI_REPLACEMENTS:
            steps.append(normalizers.Replace(Regex(pattern) if is_regex else pattern, replacement))
    elif preset != "generic":
        raise config_error(
            "tokenizer.preset",
            f"must be 'bengali' or 'generic', got {preset!r}",
            "pick one of them",
        )
    if lowercase:
        steps.append(normalizers.Lowercase())
    return normalizers.Sequence(steps)


def build_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Metaspace word starts, then digits and punctuation split into pieces of their own."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement=WORD_START, prepend_scheme="always"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),  # behaviour "isolated"
        ]
    )


def build_post_processor() -> processors.TemplateProcessing:
    """``[CLS] A [SEP]`` and ``[CLS] A [SEP] B [SEP]`` with type ids 0 for A and 1 for B."""
    return processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", CLS_ID), ("[SEP]", SEP_ID)],
    )


def _special_tokens() -> list[AddedToken]:
    # [MASK] eats the space before it, so "word [MASK]" masks a whole word piece (sahajBERT
    # README's hand edit, done here at creation).
    return [
        AddedToken(token, special=True, normalized=False, lstrip=(token == "[MASK]"), rstrip=False)
        for token in SPECIAL_TOKENS
    ]


def new_tokenizer(config: TokenizerConfig) -> Tokenizer:
    """An untrained tokenizer with the recipe's normalizer, pre-tokenizer and decoder."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = build_normalizer(config.preset, config.lowercase)
    tokenizer.pre_tokenizer = build_pre_tokenizer()
    tokenizer.decoder = decoders.Metaspace(replacement=WORD_START, prepend_scheme="always")
    return tokenizer


def _batched(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def train_tokenizer(
    texts: Iterable[str],
    config: TokenizerConfig,
    *,
    total: int | None = None,
    progress: bool = True,
) -> Tokenizer:
    """Train the recipe's Unigram model on a stream of documents.

    The stream is read once, in batches, with a tqdm progress bar over documents; the Unigram
    EM fit that follows runs in Rust (minutes for a few GB of text) and is logged, not barred.

    Args:
        texts: documents (strings); a generator over a streaming dataset is fine.
        config: the tokenizer settings (preset, vocabulary size, ...).
        total: number of documents, if known, so the progress bar shows an ETA.
        progress: show the progress bar.

    Returns:
        The trained tokenizer, with special tokens at ids 0-4 and the post-processor set.

    Raises:
        ConfigError: the text was empty (nothing to learn a vocabulary from).
    """
    tokenizer = new_tokenizer(config)
    trainer = trainers.UnigramTrainer(
        vocab_size=config.vocab_size,  # counts the special tokens (tokenizers >= 0.13)
        special_tokens=_special_tokens(),
        unk_token="<unk>",  # sets model.unk_id = 1 (sahajBERT patched this by hand)
        max_piece_length=config.max_piece_length,
        show_progress=False,  # Rust progress bars garble notebook output; tqdm below instead
    )
    seen = 0

    def counted(batches: Iterable[list[str]]) -> Iterator[list[str]]:
        nonlocal seen
        with tqdm(
            total=total, desc="tokenizer: reading text", unit="doc", disable=not progress
        ) as bar:
            for batch in batches:
                seen += len(batch)
                bar.update(len(batch))
                yield batch
        logger.info("tokenizer: read %d documents, fitting the Unigram model", seen)

    tokenizer.train_from_iterator(counted(_batched(texts, TRAIN_BATCH_DOCUMENTS)), trainer=trainer)
    if seen == 0 or tokenizer.get_vocab_size() <= len(SPECIAL_TOKENS):
        raise config_error(
            "tokenizer training text",
            f"gave no vocabulary ({seen} documents read)",
            "check tokenizer.train_sources and that the sources hold text",
        )
    for token_id, token in enumerate(SPECIAL_TOKENS):
        # Internal invariant: the trainer puts special tokens first, in the order given.
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    tokenizer.post_processor = build_post_processor()
    logger.info("tokenizer: trained a vocabulary of %d pieces", tokenizer.get_vocab_size())
    return tokenizer


def save_tokenizer(
    tokenizer: Tokenizer, folder: str | Path, *, model_max_length: int = 512
) -> Path:
    """Save as a ``transformers`` fast tokenizer folder (``tokenizer.json`` + configs).

    ``AutoTokenizer.from_pretrained(folder)`` loads it offline, returning ``token_type_ids``
    (ALBERT needs them) and the special tokens of the recipe.

    Args:
        tokenizer: a tokenizer made by :func:`train_tokenizer`.
        folder: where to write; created if missing.
        model_max_length: longest input the model takes (tokenizer_config.json).

    Returns:
        The folder.
    """
    from transformers import PreTrainedTokenizerFast  # heavy import, only needed here

    folder = Path(folder)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="[CLS]",
        eos_token="[SEP]",
        unk_token="<unk>",
        sep_token="[SEP]",
        pad_token="<pad>",
        cls_token="[CLS]",
        mask_token=AddedToken("[MASK]", lstrip=True, rstrip=False, normalized=False, special=True),
        model_max_length=model_max_length,
        padding_side="right",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    wrapped.save_pretrained(str(folder))
    # transformers 5 records its internal backend class name; 4.x (still common on Colab) only
    # knows PreTrainedTokenizerFast, which 5.x maps to the same backend. Write the portable name.
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    logger.info("tokenizer: saved to %s", folder)
    return folder


def load_tokenizer(name_or_path: str | Path, *, revision: str | None = None) -> Tokenizer:
    """Load the fast ``tokenizers`` object of a saved tokenizer (for the data pipeline).

    Args:
        name_or_path: a folder written by :func:`save_tokenizer`, a ``tokenizer.json`` file, or a
            Hub repo id (its ``tokenizer.json`` is downloaded through ``huggingface_hub``).
        revision: Hub revision to pin, if loading from the Hub.

    Raises:
        DataSourceNotFound: no such folder/file, or no such Hub repo (or no tokenizer.json in it).
        DataSourceUnreachable: the Hub cannot be reached and the file is not cached.
    """
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    name = str(name_or_path)
    if name.count("/") != 1 or path.exists() or name.startswith((".", "/")):
        raise DataSourceNotFound(
            f"no tokenizer at {name!r} (no tokenizer.json there) - help: run `kit tokenizer train` "
            "or give the folder it wrote, or a Hub repo id like 'org/name'"
        )
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        file = hf_hub_download(
            name, "tokenizer.json", revision=revision, endpoint=os.environ.get("HF_ENDPOINT")
        )
    except (LocalEntryNotFoundError, ConnectionError) as error:  # offline, not in the cache
        raise DataSourceUnreachable(
            f"cannot reach the Hub for tokenizer {name!r}: {error} - help: check your network "
            "and retry, or pass a local folder"
        ) from error
    except HfHubHTTPError as error:
        raise DataSourceNotFound(
            f"cannot fetch tokenizer.json of Hub repo {name!r}: {error} - help: check the repo id "
            "(and that your token may read it), or pass a local folder"
        ) from error
    return Tokenizer.from_file(file)


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A short hash of what decides token ids (normalizer, pre-tokenizer, model, added tokens).

    Truncation and padding settings are left out: they don't change which id a piece gets.
    Pre-tokenized shards record it so a pipeline never mixes ids of two tokenizers.
    """
    state = json.loads(tokenizer.to_str())
    relevant = {
        key: state.get(key) for key in ("normalizer", "pre_tokenizer", "model", "added_tokens")
    }
    model = dict(relevant["model"] or {})
    if isinstance(model.get("vocab"), list):
        # Unigram scores lose their last digit in a save/load round trip: compare 6 decimals.
        model["vocab"] = [[piece, round(score, 6)] for piece, score in model["vocab"]]
    relevant["model"] = model
    digest = hashlib.sha256(
        json.dumps(relevant, sort_keys=True, ensure_ascii=False).encode("utf-8")
    )
    return digest.hexdigest()[:16]


def push_tokenizer_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    endpoint: str | None = None,
    private: bool = False,
    commit_message: str = "Upload tokenizer trained with kit",
) -> str:
    """Upload a saved tokenizer folder to a Hub model repo (created if it doesn't exist).

    Args:
        folder: a folder written by :func:`save_tokenizer`.
        repo_id: ``"owner/name"`` of the model repo.
        token: Hub token with write access; None uses the logged-in token / ``HF_TOKEN``.
        endpoint: Hub URL; None uses ``HF_ENDPOINT`` (read now, not at import) or huggingface.co.
        private: create the repo as private.
        commit_message: message of the upload commit.

    Returns:
        The URL of the commit.

    Raises:
        DataSourceNotFound: the folder has no tokenizer.json.
        huggingface_hub.errors.HfHubHTTPError: the Hub refused (bad token, no write access, ...).
    """
    from huggingface_hub import HfApi

    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise DataSourceNotFound(
            f"{folder} has no tokenizer.json - help: save the tokenizer with save_tokenizer() first"
        )
    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT"), token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        repo_type="model",
        commit_message=commit_message,
        allow_patterns=["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"],
    )
    logger.info("tokenizer: pushed %s to %s", folder, repo_id)
    return str(getattr(commit, "commit_url", commit))


# --- training text from the run's data sources -----------------------------------------------


def open_training_sources(config: DataConfig, names: Sequence[str] = ()) -> list[TextSource]:
    """Open the text sources of ``config`` (all, or the ones in ``names``) for tokenizer training.

    The data filters apply (empty/short/invalid lines are dropped and counted); the order of
    documents doesn't matter to the trainer, so there is no shuffling.

    Pre-tokenized sources hold no text: they are skipped when ``names`` is empty and refused
    when named.

    Raises:
        ConfigError: no text source to open, or ``names`` names an unknown/pre-tokenized source.
    """
    chosen = [config.source_named(name) for name in names] if names else list(config.sources)
    for source in chosen:
        if names and source.pretokenized:
            raise config_error(
                f"source {source.name!r}",
                "is pre-tokenized and holds no text",
                "train the tokenizer on text sources (tokenizer.train_sources)",
            )
    text_sources = [source for source in chosen if not source.pretokenized]
    if not text_sources:
        raise config_error(
            "data.sources", "has no text source", "list at least one text source under data.sources"
        )
    return [
        TextSource(
            source,
            min_chars=config.min_chars,
            on_invalid_text=config.on_invalid_text,
            shard_seed=derive_seed("tokenizer", source.name),
        )
        for source in text_sources
    ]


def iter_training_text(sources: Sequence[TextSource], limit: int | None = None) -> Iterator[str]:
    """One pass over each source in turn (for tokenizer training), up to ``limit`` documents."""
    produced = 0
    for source in sources:
        while limit is None or produced < limit:
            document = source.next_document()
            if document is None:
                break
            produced += 1
            yield document
        counts = source.counts()
        logger.info(
            "tokenizer text: source %r read %d, used %d, dropped %d empty / %d short / %d invalid",
            source.name,
            counts.read,
            counts.used,
            counts.empty,
            counts.too_short,
            counts.invalid_text,
        )


def train_run_tokenizer(
    tokenizer_config: TokenizerConfig, data_config: DataConfig, *, progress: bool = True
) -> tuple[Tokenizer, list[TextSource]]:
    """Train the run's tokenizer on its text sources and save it in ``output_dir``.

    What ``kit tokenizer train`` and the config notebook do: one pass over
    ``tokenizer.train_sources`` (all text sources if empty, up to ``max_train_documents``),
    the recipe's Unigram model, a ``transformers`` folder. Returns the tokenizer and the opened
    sources (their counts say what was read and dropped).

    Raises:
        ConfigError: no text source, or no text in them. DataError: a source cannot be opened.
    """
    sources = open_training_sources(data_config, tokenizer_config.train_sources)
    texts = iter_training_text(sources, tokenizer_config.max_train_documents)
    tokenizer = train_tokenizer(
        texts, tokenizer_config, total=tokenizer_config.max_train_documents, progress=progress
    )
    save_tokenizer(
        tokenizer, tokenizer_config.output_dir, model_max_length=tokenizer_config.model_max_length
    )
    return tokenizer, sources
