"""Grammars and schemas of issue 51 rows 1 and 2, by size: chains that llguidance's
native compiler crashes on (3,000 Lark rules, a 3,000-deep ``$ref`` chain) or spends
seconds on (GBNF of thousands of rules)."""


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf(n: int) -> str:
    return (
        "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "a"\n' for i in range(n)) + f'r{n} ::= "x"\n'
    )


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}
