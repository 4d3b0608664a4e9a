"""Aggregate py-spy raw output: share of samples under the timed loop's line by function (inclusive)."""
import collections, sys
path, marker = sys.argv[1], sys.argv[2]
tot = collections.Counter(); n = 0
for l in open(path).read().splitlines():
    stack, cnt = l.rsplit(' ', 1); cnt = int(cnt)
    frames = stack.split(';')
    if not any(marker in f for f in frames): continue
    n += cnt
    seen = set()
    for f in frames:
        name = f.split(' (')[0] + ' (' + f.split(' (')[1].split(':')[0] + ')' if ' (' in f else f
        if name not in seen:
            tot[name] += cnt; seen.add(name)
print("samples in timed loop", n)
for name, c in tot.most_common(int(sys.argv[3]) if len(sys.argv) > 3 else 50):
    print(f"{c / n * 100:6.1f}%  {c:6d}  {name}")
