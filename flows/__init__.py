"""gpumigrate.flows — see DESIGN.md for what this folder owns."""
