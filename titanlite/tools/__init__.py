"""Layer 6, the tools reachable as `titanlite <tool>`: plan, bench, analyze, prepare."""
