"""The volunteer's join notebook: one code cell, with the coordinator's link already in it.

``notebooks/join.ipynb`` is :func:`join_notebook` with a placeholder link (a test keeps the two
equal), and every coordinator serves it filled in at ``GET /join.ipynb``; its dashboard shows
:func:`join_cell` with a copy button. The cell installs the organizer's kit from the coordinator
(``/api/run`` gives the wheel's URL under ``install``, its SHA-256 under ``install_sha256``,
which the cell pins (``URL#sha256=...``: pip checks it), and under ``install_extras`` the extras
the run needs, e.g. ``eightbit`` for an 8-bit LAMB; see ``kit.wheel`` for why two ``pip`` lines
upgrade nothing) and calls ``kit.join``. It doesn't install or join anything itself.
"""

from __future__ import annotations

import json
from typing import Any

#: The link in ``notebooks/join.ipynb`` (the volunteer replaces it, or downloads the filled-in
#: notebook from the coordinator's dashboard).
PLACEHOLDER_LINK = "https://coordinator.example.org"
#: Where a coordinator serves the notebook with its own link in it.
JOIN_NOTEBOOK_PATH = "/join.ipynb"

INTRODUCTION = """\
# Join the training run

You are about to lend this machine's GPU (or CPU) to a model that a whole community trains
together, the way [sahajBERT](https://huggingface.co/neuropark/sahajBERT) was trained by 40
volunteers. Your machine computes gradients on its share of the data and averages them with the
other volunteers over the Internet; you can stop at any moment without harming the run.

**How to run it**

- **Google Colab:** *File → Upload notebook* (this file), or a new notebook with the cell below
  pasted in; then *Runtime → Change runtime type → T4 GPU*. Optional: add your Hugging Face
  token as the Colab secret `HF_TOKEN` (the key icon on the left) to skip the login box.
- **Kaggle:** *Create → New notebook → File → Import notebook* (this file), or paste the cell;
  then *Settings → Accelerator → GPU T4 x2* and *Settings → Internet → on*. Optional:
  *Add-ons → Secrets → `HF_TOKEN`*.
- **Your own Jupyter:** just run it. On a server without Jupyter: `kit join LINK`.

Run the one cell below. It installs the organizer's kit from the run's coordinator (lower bounds
only: nothing Colab or Kaggle preinstalled is upgraded). If the run is allowlisted, a login box
asks for a Hugging Face access token (*huggingface.co → Settings → Access Tokens*, the **read**
role is enough; it is sent only to the run's coordinator, which checks who you are). Then a
panel shows the training loss, the peers online, the progress toward the next global step and
your place on the leaderboard. Press **Stop** (or interrupt the kernel) to leave.
"""

_CELL = """\
# The link the organizer gave you:
COORDINATOR = {link}
INSTALL = True  # install the organizer's kit from its coordinator (False: use the kit installed here)

if INSTALL:  # --no-deps --force-reinstall: the organizer's build; then only missing dependencies
    import json, urllib.parse, urllib.request
    with urllib.request.urlopen(COORDINATOR + "/api/run", timeout=60) as answer:
        RUN = json.load(answer)
    WHEEL = urllib.parse.urljoin(COORDINATOR + "/", RUN["install"])
    WHEEL += "#sha256=" + RUN["install_sha256"]  # pip refuses a wheel with other bytes
    EXTRAS = ",".join(RUN.get("install_extras", []))  # e.g. eightbit: the run's 8-bit LAMB
    %pip install -q --no-deps --force-reinstall {{WHEEL}}
    %pip install -q "kit-collab[{{EXTRAS}}] @ {{WHEEL}}"
import kit

volunteer = kit.join(COORDINATOR)"""


def join_cell(link: str = PLACEHOLDER_LINK) -> str:
    """The one code cell that joins the run at ``link`` (installs the organizer's kit first)."""
    return _CELL.format(link=json.dumps(link))


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def join_notebook(link: str = PLACEHOLDER_LINK) -> dict[str, Any]:
    """The join notebook (nbformat 4 JSON) for the run at ``link``; Colab opens it on a T4."""
    return {
        "cells": [
            {
                "cell_type": "markdown",
                "id": "about",
                "metadata": {},
                "source": _lines(INTRODUCTION),
            },
            {
                "cell_type": "code",
                "execution_count": None,
                "id": "join",
                "metadata": {},
                "outputs": [],
                "source": _lines(join_cell(link)),
            },
        ],
        "metadata": {
            "accelerator": "GPU",  # Colab: open with a GPU runtime
            "colab": {"gpuType": "T4", "provenance": []},
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def join_notebook_bytes(link: str = PLACEHOLDER_LINK) -> bytes:
    """:func:`join_notebook` as the bytes of an ``.ipynb`` file."""
    return (json.dumps(join_notebook(link), indent=1, ensure_ascii=False) + "\n").encode()
