"""gpumigrate.snapshot — see DESIGN.md for what this folder owns."""
