"""gpumigrate.parity — see DESIGN.md for what this folder owns."""
