#!/usr/bin/env python3
"""Lists Rust functions longer than a limit (FN_LINE_LIMIT, default 80 lines
from `fn` to its closing brace) under the given folders (default: the library
code in crates/, models/ and src/); exits 1 if there is one. Comments, strings
and char literals are blanked before braces are counted. CI runs it."""
import os, re, sys

FN = re.compile(r'\bfn\s+([A-Za-z_][A-Za-z0-9_]*)')

def strip(src):
    """Source with comments, strings and char literals blanked (newlines kept)."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith('//', i):
            j = src.find('\n', i)
            j = n if j < 0 else j
            out.append(' ' * (j - i)); i = j
        elif src.startswith('/*', i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith('/*', j): depth += 1; j += 2
                elif src.startswith('*/', j): depth -= 1; j += 2
                else: j += 1
            out.append(re.sub(r'[^\n]', ' ', src[i:j])); i = j
        elif re.match(r'b?r#*"', src[i:i+40]) and (i == 0 or not (src[i-1].isalnum() or src[i-1] == '_')):
            m = re.match(r'b?r(#*)"', src[i:])
            end = '"' + m.group(1)
            j = src.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r'[^\n]', ' ', src[i:j])); i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == '\\' else 1
            j += 1
            out.append(re.sub(r'[^\n]', ' ', src[i:j])); i = j
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'])'", src[i:])
            if m:
                out.append(' ' * m.end()); i += m.end()
            else:
                out.append(c); i += 1  # a lifetime
        else:
            out.append(c); i += 1
    return ''.join(out)

def functions(path):
    src = strip(open(path, encoding='utf-8').read())
    for m in FN.finditer(src):
        # the body starts at the first '{' before any ';' (a declaration has none)
        j = m.end()
        depth_paren = 0
        while j < len(src):
            ch = src[j]
            if ch in '([': depth_paren += 1
            elif ch in ')]': depth_paren -= 1
            elif ch == ';' and depth_paren == 0: j = -1; break
            elif ch == '{' and depth_paren == 0: break
            j += 1
        if j < 0 or j >= len(src):
            continue
        depth, k = 0, j
        while k < len(src):
            if src[k] == '{': depth += 1
            elif src[k] == '}':
                depth -= 1
                if depth == 0: break
            k += 1
        start = src.count('\n', 0, m.start()) + 1
        end = src.count('\n', 0, k) + 1
        yield m.group(1), start, end

def main():
    limit = int(os.environ.get('FN_LINE_LIMIT', '80'))
    roots = sys.argv[1:] or ['crates', 'models', 'src']
    bad = []
    for root in roots:
        for d, _, files in os.walk(root):
            for f in sorted(files):
                if f.endswith('.rs'):
                    p = os.path.join(d, f)
                    for name, a, b in functions(p):
                        if b - a + 1 > limit:
                            bad.append((b - a + 1, p, a, name))
    for n, p, a, name in sorted(bad, reverse=True):
        print(f'{p}:{a}: fn {name} is {n} lines')
    print(f'{len(bad)} functions over {limit} lines', file=sys.stderr)
    return 1 if bad else 0

if __name__ == '__main__':
    sys.exit(main())
