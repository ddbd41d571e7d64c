"""Process groups and what travels between them: collectives, the CP / DP / TP mesh, data-parallel helpers."""
