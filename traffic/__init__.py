"""gpumigrate.traffic — see DESIGN.md for what this folder owns."""
