import sys

from llamax.cli import main

sys.exit(main())
