import sys

from neorec.cli import main

sys.exit(main())
