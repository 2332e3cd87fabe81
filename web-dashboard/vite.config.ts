// Vite build of the dashboard; the coordinator serves dist/ at /dashboard/ (--dashboard-dir).
import { defineConfig } from 'vite';

export default defineConfig({
  base: '/dashboard/',
  build: { outDir: 'dist', emptyOutDir: true, chunkSizeWarningLimit: 1000 },
  server: {
    // `npm run dev` against a coordinator on the default address.
    proxy: { '/v1': 'http://127.0.0.1:8080', '/metrics': 'http://127.0.0.1:8080' },
  },
});
