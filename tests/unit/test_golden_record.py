"""The golden files' comparison (tests/golden/record.py): bit for bit within a recorded numerics
class, within the measured cross-class tolerance (and deterministic) in a class not recorded."""

from __future__ import annotations

import math

import pytest
import torch

from tests.golden import record
from tests.golden.numerics import numerics_class

DEFINITION = {"run": "toy"}


def numbers(scale: float = 1.0, weight: torch.Tensor | None = None) -> dict:
    w = torch.linspace(-1, 1, 12).reshape(3, 4) if weight is None else weight
    return {
        "losses": record.hex_floats([4.0 * scale, 3.5 * scale, 3.25 * scale]),
        "final_weights": record.weights_fingerprint({"w": w, "b": torch.ones(4)}),
    }


def one_ulp_up(hex_value: str) -> str:
    return math.nextafter(float.fromhex(hex_value), math.inf).hex()


@pytest.fixture
def curves(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "CURVES", tmp_path / "tests" / "golden" / "curves")
    return record.CURVES


def write(classes: dict[str, dict]) -> None:
    for name, nums in classes.items():
        record.write_golden("toy", DEFINITION, nums, "test", name, keep_classes=True)


def test_a_one_ulp_change_fails_in_a_recorded_class_naming_run_step_and_class(curves):
    write({"class A": numbers(), "class B": numbers(1 + 1e-6)})
    for cls in ("class A", "class B"):
        base = numbers() if cls == "class A" else numbers(1 + 1e-6)
        record.check_against_golden("toy", DEFINITION, lambda cls=cls, base=base: (cls, base))  # equal: passes
        planted = {**base, "losses": [base["losses"][0], one_ulp_up(base["losses"][1]), base["losses"][2]]}
        with pytest.raises(AssertionError) as info:
            record.check_against_golden("toy", DEFINITION, lambda cls=cls, planted=planted: (cls, planted))
        message = str(info.value)
        assert "golden run 'toy'" in message and f"numerics class {cls!r} (recorded" in message
        assert "losses differs first at step 2 of 3" in message


def test_a_one_ulp_change_of_one_weight_fails_in_a_recorded_class(curves):
    write({"class A": numbers()})
    w = torch.linspace(-1, 1, 12).reshape(3, 4)
    w[1, 2] = torch.nextafter(w[1, 2], torch.tensor(2.0))
    with pytest.raises(AssertionError, match="final weights differ in 1 of 2 tensors, first 'w'"):
        record.check_against_golden("toy", DEFINITION, lambda: ("class A", numbers(weight=w)))


def test_the_tolerance_is_the_margin_times_the_measured_difference_with_a_floor(curves):
    write({"class A": numbers(), "class B": numbers(1 + 1e-4), "class C": numbers(1 - 2e-4)})
    tolerance = record.read_golden("toy")["tolerance"]
    assert tolerance["measured"]["losses"] == pytest.approx(2e-4, rel=1e-3)
    assert tolerance["allowed"]["losses"] == pytest.approx(record.MARGIN * 2e-4, rel=1e-3)
    assert tolerance["measured"]["final_weights"] == 0.0  # the classes' weights agree
    assert tolerance["allowed"]["final_weights"] == record.FLOOR_ULPS * torch.finfo(torch.float32).eps


def test_a_class_not_recorded_passes_within_the_tolerance_and_is_computed_twice(curves):
    write({"class A": numbers(), "class B": numbers(1 + 1e-5)})
    calls = []

    def compute():
        calls.append(1)
        return "class new", numbers(1 - 5e-5)  # 5x the measured difference, inside 10x

    record.check_against_golden("toy", DEFINITION, compute)
    assert len(calls) == 2


def test_a_class_not_recorded_fails_outside_the_tolerance_naming_the_class(curves):
    write({"class A": numbers(), "class B": numbers(1 + 1e-5)})
    with pytest.raises(AssertionError) as info:
        record.check_against_golden("toy", DEFINITION, lambda: ("class new", numbers(1 + 2e-4)))
    message = str(info.value)
    assert "numerics class 'class new' (not recorded; compared with class 'class A'" in message
    assert "losses leaves the tolerance first at step 1 of 3" in message


def test_a_moved_weight_fails_outside_the_tolerance(curves):
    write({"class A": numbers(), "class B": numbers(1 + 1e-5)})
    w = torch.linspace(-1, 1, 12).reshape(3, 4)
    w[0, 0] += 1e-3
    with pytest.raises(AssertionError, match="final weights leave the tolerance in 1 of 2 tensors"):
        record.check_against_golden("toy", DEFINITION, lambda: ("class new", numbers(weight=w)))


def test_a_class_not_recorded_must_be_deterministic(curves):
    write({"class A": numbers(), "class B": numbers(1 + 1e-5)})
    results = iter([numbers(1 + 1e-6), numbers(1 + 2e-6)])
    with pytest.raises(AssertionError, match="not deterministic: computed twice, losses differs first at step 1"):
        record.check_against_golden("toy", DEFINITION, lambda: ("class new", next(results)))


def test_regenerating_without_keeping_classes_drops_the_stale_ones(curves):
    write({"class A": numbers(), "class B": numbers(1 + 1e-5)})
    record.write_golden("toy", DEFINITION, numbers(2.0), "test", "class B", keep_classes=False)
    golden = record.read_golden("toy")
    assert list(golden["classes"]) == ["class B"] and golden["anchor"] == "class B"


def test_the_numerics_class_names_torch_the_kernel_class_and_a_stable_fingerprint():
    name = numerics_class()
    assert name.startswith(f"torch {torch.__version__}, ATen {torch.backends.cpu.get_cpu_capability()}, kernels ")
    from tests.golden.numerics import fingerprint

    assert fingerprint() == name.rsplit(" ", 1)[1]  # the same bits twice in one process
