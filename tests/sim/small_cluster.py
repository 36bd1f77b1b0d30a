"""A small cluster for end-to-end simulations in tests: four fake nodes, 2P2D after a
2-minute warm-up, 2-minute windows of 4 slices, small caches (memory pressure in seconds)."""

SMALL = """
[cluster]
nodes = [{ name = "n0" }, { name = "n1" }, { name = "n2" }, { name = "n3" }]
initial_prefill = 2
[planner]
t_learn = 120.0
t_win = 120.0
m = 4
hold_off = 30.0
[fake]
noise = 0.03
l1_tokens = 400000
l2_tokens = 1600000
"""
