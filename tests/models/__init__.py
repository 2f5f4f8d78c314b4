"""The test model zoo: small models that exercise one structural feature each."""
