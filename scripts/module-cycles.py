#!/usr/bin/env python3
"""Finds module cycles inside each crate: two top-level modules that reach each
other through `crate::x` / `super::x` paths (also inside `use crate::{..}`
groups), found with Tarjan's strongly connected components. With
`--through-root`, a path to a name that `lib.rs` re-exports (`crate::Name`
where lib.rs says `pub use x::Name`) also counts as a reference to `x`. Comments and strings are
blanked first. Prints each cycle and exits 1 if there is one. CI runs it."""
import importlib.util, os, re, sys

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location('fn_length', os.path.join(HERE, 'fn-length.py'))
_fn_length = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fn_length)
strip = _fn_length.strip  # comments, strings and char literals blanked

IDENT = r'[A-Za-z_][A-Za-z0-9_]*'
THROUGH_ROOT = False  # --through-root: also follow lib.rs's re-exports


def crate_roots(top):
    """The `src/` folders of the workspace's library crates."""
    cands = [os.path.join('crates', d) for d in sorted(os.listdir(os.path.join(top, 'crates')))]
    cands += ['models', 'kernels', '.']
    return [os.path.normpath(os.path.join(top, c, 'src')) for c in cands
            if os.path.isfile(os.path.join(top, c, 'src', 'lib.rs'))]


def top_modules(src):
    """Top-level module name -> the files that make it up."""
    mods = {}
    for name in sorted(os.listdir(src)):
        p = os.path.join(src, name)
        if name.endswith('.rs') and name not in ('lib.rs', 'main.rs'):
            mods.setdefault(name[:-3], []).append(p)
        elif os.path.isdir(p):
            for d, _, files in os.walk(p):
                mods.setdefault(name, []).extend(os.path.join(d, f) for f in sorted(files) if f.endswith('.rs'))
    return mods


def group_heads(text):
    """The first segments of the paths in a `{a, b::c, d::{e}}` group."""
    heads, depth, cur = [], 0, ''
    for ch in text:
        if ch == '{':
            depth += 1
        elif ch == '}':
            depth -= 1
        elif ch == ',' and depth == 0:
            heads.append(cur); cur = ''
            continue
        if depth == 0 and ch not in '{}':
            cur += ch
    heads.append(cur)
    return [m.group(0) for h in heads for m in [re.match(IDENT, h.strip())] if m]


def matching_brace(src, i):
    depth = 0
    for j in range(i, len(src)):
        if src[j] == '{':
            depth += 1
        elif src[j] == '}':
            depth -= 1
            if depth == 0:
                return j
    return len(src)


def root_names(src_text, prefixes):
    """First path segments after any of the prefixes (`crate::`, `super::`)."""
    names = []
    for pre in prefixes:
        for m in re.finditer(r'(?<![A-Za-z0-9_:])' + re.escape(pre) + r'\s*(\{|' + IDENT + ')', src_text):
            if m.group(1) == '{':
                start = m.end(1) - 1
                names += group_heads(src_text[start + 1:matching_brace(src_text, start)])
            else:
                names.append(m.group(1))
    return names


def reexports(lib_text, mods):
    """Names that lib.rs re-exports from a top-level module: name -> module."""
    out = {}
    for m in re.finditer(r'\bpub(?:\([^)]*\))?\s+use\s+(' + IDENT + r')\s*::\s*([^;]*);', lib_text):
        mod = m.group(1)
        if mod not in mods:
            continue
        rest = m.group(2).strip()
        if rest.startswith('{'):
            body = rest[1:rest.rfind('}')]
            for part in body.split(','):
                seg = [s for s in re.findall(IDENT, part.split(' as ')[-1])]
                if seg:
                    out[seg[-1]] = mod
        else:
            seg = re.findall(IDENT, rest.split(' as ')[-1])
            if seg:
                out[seg[-1]] = mod
    return out


def edges(src):
    mods = top_modules(src)
    lib = strip(open(os.path.join(src, 'lib.rs'), encoding='utf-8').read())
    alias = reexports(lib, mods)
    graph = {m: set() for m in mods}
    for mod, files in mods.items():
        for f in files:
            text = strip(open(f, encoding='utf-8').read())
            # `super::` in a top-level file is the crate root; one level down it
            # is the module itself, so only `super::super::` leaves it.
            depth = os.path.relpath(f, src).count(os.sep)
            is_mod_rs = os.path.basename(f) == 'mod.rs'
            up = depth - (1 if is_mod_rs else 0)
            prefixes = ['crate::', 'super::' * (up + 1)]
            for name in root_names(text, prefixes):
                target = name if name in mods else (alias.get(name) if THROUGH_ROOT else None)
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def tarjan(graph):
    index, low, on, stack, sccs, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]; counter[0] += 1
        stack.append(v); on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop(); on.discard(w); scc.append(w)
                if w == v:
                    break
            sccs.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [s for s in sccs if len(s) > 1]


def main():
    global THROUGH_ROOT
    args = sys.argv[1:]
    THROUGH_ROOT = '--through-root' in args
    args = [a for a in args if a != '--through-root']
    top = os.path.dirname(HERE)
    roots = args or crate_roots(top)
    found = 0
    for src in roots:
        graph = edges(src)
        for scc in tarjan(graph):
            found += 1
            inner = {m: sorted(graph[m] & set(scc)) for m in scc}
            print(f'{os.path.relpath(src, top)}: cycle {{{", ".join(scc)}}}: ' +
                  '; '.join(f'{m} -> {", ".join(t)}' for m, t in inner.items()))
    print(f'{found} module cycles in {len(roots)} crates', file=sys.stderr)
    return 1 if found else 0


if __name__ == '__main__':
    sys.exit(main())
