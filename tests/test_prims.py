"""prims._eq: the shape-equality test every signature constructor asks (issue 35 item 10: trace speed)."""

from __future__ import annotations

import sympy

from partita import prims

B, S = sympy.Symbol("B"), sympy.Symbol("S")
POS = sympy.Symbol("n", positive=True, integer=True)


def _fresh() -> None:
    """Forget the answers an earlier test memoised."""
    cached = getattr(prims, "_eq_cached", None)
    if cached is not None:
        cached.cache_clear()


def test_symbolic_dims_that_differ_need_no_simplify(monkeypatch) -> None:
    """A traced transformer asks whether ``S`` or ``B`` is ``1`` dozens of times per block; each
    ``sympy.simplify`` cost ~7 ms (0.7 CPU s of a Qwen2 trace). A probe value decides them."""
    calls = []
    real = sympy.simplify
    monkeypatch.setattr(sympy, "simplify", lambda e, *a, **k: calls.append(e) or real(e, *a, **k))
    _fresh()
    sig = prims.reshape((B, S, 64, 128), (B, S, 8192))
    assert sig.inputs[0][:2] == sig.outputs[0][:2]  # B and S keep their labels through the reshape
    prims.elementwise((B, S, 8192), [(B, S, 8192), (1, S, 1)])
    assert not prims._eq(S, 1) and not prims._eq(B * S, B) and not prims._eq(1, B)
    assert calls == []


def test_same_answers_as_simplify() -> None:
    """Where the probe does not decide (the difference is zero there, or a symbol has assumptions),
    ``simplify`` does, so the answer is the old one: identically equal expressions that differ in form
    are equal, different ones are not."""
    pairs = [
        ((B + 1) ** 2, B**2 + 2 * B + 1),
        (B * S, S * B),
        (sympy.floor(S / 2) * 2, S),
        (S / 2 + S / 2, S),
        (B * S, B),
        (S, 1),
        (POS, 1),
        (POS * 2, POS + POS),
        (sympy.Integer(4), 4),
        (4, 5),
    ]
    _fresh()
    for a, b in pairs:
        assert prims._eq(a, b) == (sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0), (a, b)
