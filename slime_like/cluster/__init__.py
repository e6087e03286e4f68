"""Placement and the node-level plumbing under every server: placement groups, processes, ports, hosts."""
