"""gpumigrate.infra — see DESIGN.md for what this folder owns."""
