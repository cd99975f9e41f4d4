from gpumigrate.cli import main

main()
