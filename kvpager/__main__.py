import sys

from kvpager.cli.main import main

sys.exit(main())
