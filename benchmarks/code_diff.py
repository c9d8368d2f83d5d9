"""Two builds of the CPU kernel library compared function by function (objdump -d): whether a change to how the
kernels are built (units, flags, the layout of the source) changed the machine code.

Addresses are normalized: jumps inside a function become offsets from its start, calls and jumps elsewhere the
callee's name, rip-relative constants (.rodata) their bytes (as many as the instruction reads), other data the
symbol. Per function: the same, the same instructions with registers or stack slots permuted (a register
allocator's tie), or different; then every caller -> callee edge that one has and the other not (inlining).

    python benchmarks/code_diff.py A.so B.so [FUNCTION ...]     # FUNCTION: print its diff
"""
from __future__ import annotations

import argparse
import collections
import difflib
import re
import subprocess

SKIP = ("_", "frame_dummy", "register_tm", "deregister_tm")


def rodata(so: str):
    """(address, file offset, size) of the .rodata sections."""
    out = subprocess.run(["readelf", "-SW", so], capture_output=True, text=True, check=True).stdout
    secs = []
    for line in out.splitlines():
        m = re.match(r"\s*\[\s*\d+\]\s+(\S+)\s+(\S+)\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)", line)
        if m and m.group(1).startswith(".rodata") and m.group(2) == "PROGBITS":
            secs.append((int(m.group(3), 16), int(m.group(4), 16), int(m.group(5), 16)))
    return secs


def operand_bytes(ins: str) -> int:
    """How many bytes an instruction's memory operand reads (enough to compare constants by value)."""
    op = ins.split()[0]
    if "{1to" in ins:
        return 8 if op.endswith(("pd", "q")) else 4
    if op.endswith(("x4", "128")):
        return 16
    if re.search(r"broadcast(ss|d)$|ss$|^vmovd$", op) or re.search(r"%e[a-z]+$|%r\d+d$", ins):
        return 4
    if re.search(r"broadcast(sd|q)$|sd$|^vmovq$", op):
        return 8
    return 64 if "%zmm" in ins else 32 if "%ymm" in ins else 16 if "%xmm" in ins else 8


def functions(so: str) -> dict:
    data, secs = open(so, "rb").read(), rodata(so)
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", so], capture_output=True, text=True,
                         check=True).stdout
    fs, cur, start = {}, None, 0

    def const(m, ins):
        addr = int(m.group(1), 16)
        if ins.split()[0] != "lea":     # lea: a table's address (a jump table's entries depend on the layout)
            for a, off, size in secs:
                if a <= addr < a + size:
                    return f"# const {data[off + addr - a:off + addr - a + operand_bytes(ins)].hex()}"
        return "# <%s>" % re.sub(r"[.]\d+$", "", m.group(2))       # CSWTCH.1776: a numbered local table

    for line in out.splitlines():
        m = re.match(r"^([0-9a-f]+) <(.*)>:", line)
        if m:
            cur, start = m.group(2), int(m.group(1), 16)
            fs[cur] = []
            continue
        m = re.match(r"^\s+[0-9a-f]+:\s+(.*)$", line)
        if not m or cur is None:
            continue
        ins = m.group(1)
        ins = re.sub(r"#\s*([0-9a-f]+) <([^>+]+)(\+0x[0-9a-f]+)?>", lambda mm: const(mm, ins), ins)

        def target(mm):
            base = re.sub(r"\+0x[0-9a-f]+$", "", mm.group(2))
            return f"<.+{int(mm.group(1), 16) - start:#x}>" if base == cur else f"<{base}>"
        ins = re.sub(r"\b([0-9a-f]+) <([^>]+)>", target, ins)
        ins = re.sub(r"-?0x[0-9a-f]+\(%rip\)", "X(%rip)", ins)
        fs[cur].append(re.sub(r"\s+", " ", ins).strip())
    for body in fs.values():                # padding after the last instruction
        while body and body[-1].startswith(("nop", "xchg %ax,%ax", "cs nop", "data16")):
            body.pop()
    return fs


def edges(fs: dict) -> collections.Counter:
    e = collections.Counter()
    for f, body in fs.items():
        for ins in body:
            m = re.match(r"(call|jmp) <([^.>][^>]*)>", ins)
            if m and m.group(2) != f:
                e[(f, m.group(2))] += 1
    return e


def masked(body: list) -> list:
    return sorted(re.sub(r"%[xyz]mm\d+|%r\d+[dwb]?|%e?[a-d]x|-?0x[0-9a-f]+\(%[re][bs]p\)", "R", i) for i in body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("show", nargs="*", help="functions whose diff to print")
    args = ap.parse_args()
    a, b = functions(args.a), functions(args.b)
    both = sorted(f for f in set(a) & set(b) if not f.startswith(SKIP) and "@plt" not in f)
    same = [f for f in both if a[f] == b[f]]
    perm = [f for f in both if a[f] != b[f] and masked(a[f]) == masked(b[f])]
    diff = [f for f in both if a[f] != b[f] and f not in perm]
    print(f"{len(both)} functions in both: {len(same)} the same, {len(perm)} permuted registers or stack slots, "
          f"{len(diff)} different; only in A: {len(set(a) - set(b))}, only in B: {len(set(b) - set(a))}")
    for f in perm:
        print(f"  permuted: {f}")
    for f in diff:
        print(f"  different: {f} ({len(a[f])} -> {len(b[f])} instructions)")
    for f in sorted(set(a) ^ set(b)):
        print(f"  only in {'A' if f in a else 'B'}: {f}")
    ea, eb = edges(a), edges(b)
    for k in sorted(set(ea) | set(eb)):
        if ea[k] != eb[k]:
            print(f"  call edge {k[0]} -> {k[1]}: {ea[k]} in A, {eb[k]} in B")
    for f in args.show:
        print("\n".join(difflib.unified_diff(a.get(f, []), b.get(f, []), f"A {f}", f"B {f}", lineterm="", n=2)))


if __name__ == "__main__":
    main()
