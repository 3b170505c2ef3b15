from weightcache.cli import main

main()
