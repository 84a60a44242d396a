"""Mixtures of experts as a capability of the shared blocks: `args` (torch-free: what a family's MoE blocks are),
`layer` (router, experts, the block, token counting and the routing bias's update) and `balance` (the
load-balancing statistics pooled over a model's blocks). Import the module you need; this package imports none
of them, so its torch-free `args` stays importable without torch."""
