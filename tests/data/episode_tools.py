"""Tools for the tool-episode tests (grpo.py --tools_module): one that works, one that sleeps, one that fails,
one that hangs."""
import time


def calculator(expression: str) -> str:
    """Sums and differences of integers, e.g. "12+30"."""
    total, sign, number = 0, 1, ""
    for ch in expression.replace(" ", "") + "+":
        if ch.isdigit():
            number += ch
        elif ch in "+-" and number:
            total, number, sign = total + sign * int(number), "", 1 if ch == "+" else -1
        else:
            raise ValueError(f"not a sum: {expression!r}")
    return str(total)


def sleepy(seconds: float) -> str:
    time.sleep(min(float(seconds), 5.0))
    return "slept"


def fails() -> str:
    raise RuntimeError("tool failed")


def hang() -> str:
    time.sleep(3600)
    return "never"


TOOLS = {"calculator": calculator, "sleepy": sleepy, "fails": fails, "hang": hang}
