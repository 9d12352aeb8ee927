"""The ``rocketstore`` command line (click + rich); the library never imports it."""
