"""Mutation score per module from mutmut's results (run by `make mutation` after `mutmut run`).

mutmut names each mutant ``<module>.x_<function>__mutmut_<n>`` (methods: ``<module>.xǁClassǁmethod__mutmut_<n>``);
this groups them by module and prints killed / total, so a module whose tests let planted bugs through stands out.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

KILLED = {"killed", "timeout", "segfault"}
"""mutmut's outcomes that mean a test noticed the change (a hang or a crash is noticed too)."""
NOT_RUN = {"not checked", "skipped"}


def main() -> int:
    mutmut = Path(sys.executable).with_name("mutmut")
    out = subprocess.run(
        [str(mutmut), "results", "--all", "true"], capture_output=True, text=True, check=True
    )
    total: Counter[str] = Counter()
    killed: Counter[str] = Counter()
    crashed: Counter[str] = Counter()
    for line in out.stdout.splitlines():
        match = re.match(r"\s*(\S+?)\.x[_ǁ]\S*__mutmut_\d+: (.+)$", line)
        if not match or match.group(2) in NOT_RUN:
            continue
        module, status = match.groups()
        total[module] += 1
        killed[module] += status in KILLED
        crashed[module] += status in KILLED - {"killed"}
    if not total:
        print("no mutmut results: run `.venv/bin/mutmut run` first", file=sys.stderr)
        return 1
    width = max(map(len, total))
    # A timeout or a crash counts as killed (a test noticed); they are shown apart because a limit
    # set too tight also reads as a timeout.
    print(f"{'module':<{width}}  killed / total  score  (timeouts and crashes among the killed)")
    for module in sorted(total):
        print(
            f"{module:<{width}}  {killed[module]:>6} / {total[module]:<5} {killed[module] / total[module]:6.1%}"
            f"  ({crashed[module]})"
        )
    all_killed, all_total = sum(killed.values()), sum(total.values())
    print(
        f"{'all':<{width}}  {all_killed:>6} / {all_total:<5} {all_killed / all_total:6.1%}"
        f"  ({sum(crashed.values())})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
