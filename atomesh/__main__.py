from atomesh.cli import main

main()
