"""The researcher's evaluation room behind ``notebooks/evaluate.ipynb`` (entry: ``kit.evaluate``;
its command ``kit evaluate ...``: ``kit.evaluate_cli``).

Map of the package (each module imports only those above it):

    metrics.py      seqeval entity-level F1, accuracy, mean ± std over seeds (pure)
    checkpoints.py  what a checkpoint is (local folder or Hub repo + revision), the
                    ``kit_checkpoint.json`` series format, tokenizer/model loading, device choice
    tasks.py        the two downstream tasks (WikiANN-bn NER, IndicGLUE sna.bn news
                    classification): dataset loading, schema checks, tokenization
    finetune.py     the plain torch fine-tuning loop and its frozen ``FinetuneConfig``
    mlm.py          masked-LM loss / perplexity of a checkpoint on held-out text
    profile.py      the CPU quick profile (a subset, few epochs, one seed) and what it leaves
                    out of the paper's protocol (pure)
    plan.py         what the notebook runs by default on this device (CPU: the quick profile
                    on the run's first and newest checkpoints; GPU: the paper's protocol) and
                    how long it will take
    report.py       the paper-style table, the metric-vs-step plot, JSON/CSV files

Importing this package imports nothing heavy; ``torch`` and ``transformers`` load with the
modules that need them.
"""
