"""Random SQL92 filters and property maps, evaluated by RocketMQ's own filter classes -> a golden file.

    CLASSPATH=classes:guava.jar:failureaccess.jar python3 generate.py COUNT SEED [--biased] > out.jsonl
"""

import base64
import json
import random
import subprocess
import sys

rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 45)
NAMES = ["a", "b", "c", "TAGS", "n", "Region"]
VALUES = ["10", "-3", "2.5", "abc", "", "true", "TRUE", "1e3", "3000000000", "9223372036854775808", "NaN",
          "Infinity", " 7 ", "+4", "0x10", "\u0663", "it's", "Tag A", "5", "0", "-0.0", "5.0", "10d", "1_0",
          "2147483647", "-2147483648", "abcdef", "TagA", "x"]
INTS = ["0", "5", "10", "2147483647", "2147483648", "9223372036854775807", "5L", "3l", "-5", "- 10"]
FLOATS = ["2.5", "1e3", ".5", "5.", "10.0", "1E-2", "0.0", "1e400", "1e-400", "3.0e1"]
STRINGS = ["'abc'", "'it''s'", "''", "'10'", "'true'", "'Tag'", "'A'", "'x'", "'5.0'"]


def value(depth):
    r = rng.random()
    if r < 0.45:
        return rng.choice(NAMES)
    if r < 0.65:
        return rng.choice(INTS)
    if r < 0.75:
        return rng.choice(FLOATS)
    if r < 0.88:
        return rng.choice(STRINGS)
    if r < 0.93:
        return rng.choice(["TRUE", "FALSE", "NULL"])
    if r < 0.97:
        return "-" + value(depth)
    return "(" + expr(depth + 1) + ")"


BIASED = "--biased" in sys.argv


def operand(depth):
    if BIASED and rng.random() < 0.7:
        return rng.choice(NAMES) if rng.random() < 0.6 else rng.choice(INTS[:7] + FLOATS[:5])
    return value(depth)


def predicate(depth):
    r = rng.random()
    v = rng.choice(NAMES) if BIASED and rng.random() < 0.8 else value(depth)
    if r < 0.45:
        return f"{v} {rng.choice(['=', '<>', '>', '>=', '<', '<='])} {operand(depth)}"
    if r < 0.55:
        return f"{v} IS {rng.choice(['', 'NOT '])}NULL"
    if r < 0.65:
        return f"{v} {rng.choice(['', 'NOT '])}BETWEEN {operand(depth)} AND {operand(depth)}"
    if r < 0.75:
        items = ", ".join(rng.choice([*STRINGS, "'TagA'", "'5'"]) for _ in range(rng.randint(1, 4)))
        return f"{v} {rng.choice(['', 'NOT '])}IN ({items})"
    if r < 0.85:
        test = rng.choice(["CONTAINS", "STARTSWITH", "ENDSWITH"])
        return f"{v} {rng.choice(['', 'NOT '])}{test} {rng.choice(STRINGS)}"
    if r < 0.92:
        return v
    return f"NOT {predicate(depth)}"


def expr(depth=0):
    if depth > 3 or rng.random() < 0.45:
        return predicate(depth)
    return f"{expr(depth + 1)} {rng.choice(['AND', 'OR', 'and', 'Or'])} {expr(depth + 1)}"


def props(e=""):
    return {name: rng.choice(VALUES) for name in NAMES if rng.random() < 0.6 and (not e or name in e)}


cases = []
for _ in range(int(sys.argv[1])):
    e = expr()
    cases.extend((e, props(e)) for _ in range(3))


def b64(text):
    return base64.b64encode(text.encode()).decode()


lines = "".join("\t".join([b64(e)] + [b64(x) for kv in p.items() for x in kv]) + "\n" for e, p in cases)
out = subprocess.run(["java", "Harness"], input=lines, capture_output=True, text=True, check=True).stdout
results = out.splitlines()
assert len(results) == len(cases)
for (e, p), r in zip(cases, results, strict=True):
    print(json.dumps({"expression": e, "properties": p, "rocketmq": r}, ensure_ascii=False))
