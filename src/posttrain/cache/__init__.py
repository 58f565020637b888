"""The cache: where step outputs live and when one is served instead of recomputed.

The store (:mod:`.store`) and its shared second level (:mod:`.shared`), the key each step's output
is filed under (:mod:`.keys`, with the code fingerprint of :mod:`.code`), the JSON record of each
result (:mod:`.records`), the digests that check an output is intact (:mod:`.digests`) and the
planner that decides, for each step, cached or run and why (:mod:`.planner`).
"""
