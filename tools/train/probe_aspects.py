#!/usr/bin/env python3
"""Does the reply answer the fact the comment asked for? 12 products x 12 questions in the corpus's own phrasings
(price, material, colours, sizes) through the real agent (`nextn agent --json`, the real commerce MCP server), each
reply classified by the fact it states. Prints the count right per aspect and per product (`--json`: as JSON).

A model whose replies follow the tool result but not the comment gives each product one fixed reply whatever was
asked (the bundled model before session 16: 44 of 144; with `agent_corpus.py --tool-fields`: 131 of 144).

    python3 tools/train/probe_aspects.py [--model DIR] [--harness DIR] [-v]
"""
import argparse
import collections
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCTS = {"p001": "crew tee", "p002": "fleece hoodie", "p003": "straight jeans", "p004": "midi skirt", "p005": "linen shirt",
            "p006": "merino sweater", "p007": "puffer jacket", "p008": "satin dress", "p009": "canvas sneakers",
            "p010": "leather bag", "p011": "cashmere scarf", "p012": "thermal leggings"}
QUESTIONS = {"price": ["what's the price of the {s}", "how much does the {s} cost", "{s} price pls", "Ben here, what does the {s} cost?"],
             "material": ["what fabric is the {s}", "what is the {s} made from", "{s} material?",
                          "is the {s} real cotton or what material is it"],
             "colours": ["what colours for the {s}", "{s} colour options?"],
             "sizes": ["what sizes for the {s}", "which sizes does the {s} have"]}
SIZE = r"(XS|S|M|L|XL|XXL|\d+|One)\b"


def stated(reply):
    """The facts a reply states, by the corpus's reply wording."""
    facts = set()
    if "yuan" in reply or "元" in reply:
        facts.add("price")
    if "made of" in reply:
        facts.add("material")
    if re.search(r"comes in " + SIZE, reply) or re.search(r" is One Size", reply):
        facts.add("sizes")
    elif re.search(r"comes in [A-Z]", reply):
        facts.add("colours")
    return facts


def right(asked, facts):
    # "price" may come with the material ("is 199 yuan, made of ..."), as the corpus's price+material replies do.
    return asked in facts and (facts == {asked} or (asked == "price" and facts <= {"price", "material"}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="model directory (default: the bundled model)")
    ap.add_argument("--harness", type=Path, default=ROOT / "harness/live-tiny")
    ap.add_argument("--nextn", type=Path, default=ROOT / "target/release/nextn")
    ap.add_argument("--mcp", type=Path, default=ROOT / "target/release/nextn-commerce-mcp")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every wrong reply")
    a = ap.parse_args()
    for p in (a.nextn, a.mcp):
        if not p.exists():
            sys.exit(f"probe_aspects: {p} not found (cargo build --release -p nextn-agent -p nextn-commerce-mcp)")
    by_aspect, by_product, wrong = collections.Counter(), collections.Counter(), []
    for pid, s in PRODUCTS.items():
        for asked, questions in QUESTIONS.items():
            for q in questions:
                comment = q.format(s=s)
                cmd = [str(a.nextn), "agent", "--comment", comment, "--harness", str(a.harness), "--mcp", f"commerce={a.mcp}", "--json"]
                if a.model:
                    cmd += ["--model", str(a.model)]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if out.returncode != 0:
                    sys.exit(f"probe_aspects: nextn agent exited {out.returncode} on {comment!r}: {out.stderr[-500:]}")
                reply = json.loads(out.stdout)["reply"]
                ok = right(asked, stated(reply))
                by_aspect[(asked, ok)] += 1
                by_product[pid] += ok
                if not ok:
                    wrong.append({"asked": asked, "comment": comment, "reply": reply})
    total = sum(len(v) for v in QUESTIONS.values()) * len(PRODUCTS)
    result = {"right": sum(by_product.values()), "questions": total,
              "by_aspect": {k: {"right": by_aspect[(k, True)], "of": by_aspect[(k, True)] + by_aspect[(k, False)]} for k in QUESTIONS},
              "by_product": dict(by_product), "wrong": wrong}
    if a.json:
        print(json.dumps(result, ensure_ascii=False))
        return
    if a.verbose:
        for w in wrong:
            print(f"{w['asked']:9s} {w['comment']!r:62s} -> {w['reply']}")
    for k, v in result["by_aspect"].items():
        print(f"{k:9s} {v['right']:3d} of {v['of']}")
    print("per product:", " ".join(f"{p}:{n}" for p, n in by_product.items()))
    print(f"right {result['right']} of {total}")


if __name__ == "__main__":
    main()
