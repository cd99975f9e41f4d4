"""gpumigrate.workloads — see DESIGN.md for what this folder owns."""
