"""Which verification a call asks for: the adaptive default, or a fixed mode named or implied.

`verify` when given; else any chain setting (length_policy, verify_len, sample_drafts,
verify_head) means chain verification, a tree_budget a fixed or "auto" tree, and nothing
at all the adaptive decoder. `generate`, the server's engines (`serving.slot_policy`) and
`adaflash serve` resolve their arguments here.
"""

from __future__ import annotations

VERIFY_MODES = ("adaptive", "chain", "tree")
CHAIN_SETTINGS = ("length_policy", "verify_len", "sample_drafts", "verify_head")


def verify_mode(verify, *, tree_budget=None, **chain_settings) -> str:
    """The verification mode of these arguments (ValueError for a contradiction).

    chain_settings: any of CHAIN_SETTINGS; None or False counts as not given."""
    if verify is not None and verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    unknown = set(chain_settings) - set(CHAIN_SETTINGS)
    if unknown:
        raise TypeError(f"not chain settings: {sorted(unknown)}")
    given = [k for k in CHAIN_SETTINGS if chain_settings.get(k) not in (None, False)]
    if verify == "adaptive" and (given or tree_budget is not None):
        raise ValueError(f"verify='adaptive' chooses its own budgets; {given or ['tree_budget']} "
                         "apply to verify='chain' or 'tree'")
    if verify is not None:
        return verify
    return "chain" if given else "tree" if tree_budget is not None else "adaptive"
