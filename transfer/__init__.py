"""gpumigrate.transfer — see DESIGN.md for what this folder owns."""
