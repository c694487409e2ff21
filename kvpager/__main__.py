import sys

from kvpager.cli import main

sys.exit(main())
