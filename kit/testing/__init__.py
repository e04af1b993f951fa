"""Test infrastructure used by kit's tests and the notebooks' dry runs.

Nothing here is imported by kit itself at run time: these are stand-ins for outside services
(e.g. :mod:`kit.testing.fake_hub`, a fake Hugging Face Hub on loopback: its data in
``hub_state``, its API answers in ``hub_api``) so that tests and dry runs never need the Internet.
"""
