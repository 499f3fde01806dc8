"""The built-in ``calculator`` tool: arithmetic on numbers, evaluated from the syntax tree.

Nothing is executed: the expression is parsed with :mod:`ast` and only number literals, the
operators ``+ - * / // % **``, unary signs, parentheses and the functions ``abs, round, min,
max, sqrt`` are evaluated. Names, attributes, calls of anything else, strings, comprehensions
and so on are rejected with a message naming the construct. Results are bounded (exponents,
digits), so ``9**9**9`` is an error instead of a hung worker.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Union

from rlhf.agent.base import Tool, ToolError

Number = Union[int, float]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}
MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_DIGITS = 1000


def _check(value: Number) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("error: the result is not a finite number")
    if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
        raise ToolError(f"error: the result has more than {MAX_DIGITS} digits")
    return value


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"error: exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("error: division by zero") from None
        except OverflowError:
            raise ToolError("error: the result is too large") from None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
            and not node.keywords:
        args = [_eval(a) for a in node.args]
        try:
            return _check(_FUNCTIONS[node.func.id](*args))
        except (TypeError, ValueError) as e:
            raise ToolError(f"error: {node.func.id}: {e}") from None
    what = type(node).__name__
    if isinstance(node, ast.Name):
        what = f"name '{node.id}'"
    raise ToolError(f"error: unsupported expression ({what}); use numbers, + - * / // % **, parentheses and "
                    f"{', '.join(_FUNCTIONS)}")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic ``expression`` (see the module docstring); ToolError when invalid."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"error: expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"error: invalid expression: {e.msg}") from None
    return _eval(tree)


def format_number(value: Number) -> str:
    """Integers exactly; floats with 12 significant digits (an integral float prints as an integer)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".12g")


class Calculator(Tool):
    """``calculator(expression)`` -> the value, e.g. ``"1234*5678"`` -> ``"7006652"``."""

    schema = {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses, abs, round, "
                       "min, max, sqrt) and return its value.",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "The expression, e.g. 1234*5678"}},
            "required": ["expression"], "additionalProperties": False}}}

    def __call__(self, expression: str) -> str:
        return format_number(evaluate(expression))
