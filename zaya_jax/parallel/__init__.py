"""Mesh construction, the logical-axis rules table, and the collectives the model needs."""
